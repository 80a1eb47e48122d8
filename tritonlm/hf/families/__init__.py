"""One module per Hugging Face family (or per small group sharing a layout), each ending in ``register(Family(...))``
(:mod:`tritonlm.hf.family`). :func:`tritonlm.hf.family.families` imports every module here: a new family is one
file (CONTRIBUTING.md, "Adding a model family")."""
