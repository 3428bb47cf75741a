"""Offline tools, never imported by the serving path: ahead-of-time compiles for described TPU topologies (aot),
capacity, the deployment planner (plan), the published chip figures they share (chips), roofline arithmetic,
batch jobs over JSONL files."""
