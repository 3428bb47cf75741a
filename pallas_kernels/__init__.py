"""Attention kernels for jaxserve: one package per kernel, each with its pure-JAX reference."""
