"""Serving with vLLM, SGLang and TokenSpeed: engine facts (data), what each engine captures for a draft,
the compatibility rules, doctor, serve-command, and the accept length of a live server."""
