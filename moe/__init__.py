"""Mixture-of-experts: router, expert-parallel token dispatch/combine, the MoE layer."""
