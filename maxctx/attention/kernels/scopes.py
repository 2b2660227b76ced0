"""The names of the scopes kernels put on their ops, which maxctx.plan.program reads back from a compiled step's
HLO. No JAX: the planner's side imports them before JAX starts."""

# The name scope in which a Pallas attention call states its visited query-key products x head dim (for query
# heads and batch together), `pallas_macs=N`: maxctx.attention.kernels.splash writes it, maxctx.plan.program reads it.
PALLAS_MACS_SCOPE = "pallas_macs="
ATTENTION_FORWARD_SCOPE = "attention_forward"  # the blockwise kernel's forward (maxctx.attention.kernels.flash)
