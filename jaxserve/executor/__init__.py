"""The one device seam: compiled prefill and decode steps over bucketed shapes, batch packing, the KV cache on device,
sampling, speculative verification and the draft model, the executable store."""
