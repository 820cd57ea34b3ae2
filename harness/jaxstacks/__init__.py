"""Real JAX serving stacks (tpu-inference, MaxText) as test oracles, each in its own virtual
environment (:mod:`.env`), with one worker module per stack exposing the stack's abstract
parameter tree, its own loader and its forward pass; see ``NOTES.md`` beside this file."""
