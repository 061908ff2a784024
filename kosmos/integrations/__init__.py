"""KOSMOS inside other libraries' models. ``kosmos.integrations.transformers.patch(model)``: the sparse MoE blocks
of a HuggingFace transformers model run on ``kosmos.nn.moe``; ``register_experts()``: "kosmos" as an experts
implementation of transformers' ExpertsInterface, on ``kosmos.nn.moe_experts`` (that module's docstring has the
contract). Importing
these modules needs neither a GPU nor the library they integrate with; a call that needs the library says so in
one line when it is missing."""
