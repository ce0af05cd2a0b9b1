"""Training the drafter with test-time training: against a live Transformers target or from states captured
with vLLM (the capture format and the capture), in one process or data-parallel under torchrun (FSDP2), from a
stored capture or one streamed through a spool while it is written (online)."""
