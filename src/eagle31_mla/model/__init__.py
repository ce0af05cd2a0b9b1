"""The drafter itself: config, model math, latent KV cache, checkpoint I/O, aux-layer ids, argument checks and
sampling. Every module here but ``flashinfer_backend`` is remote code (torch + transformers only, relative
imports among themselves): ``modeling/`` is generated from them (:mod:`eagle31_mla.hub.remote_code`)."""
