"""How a model server turns each API's request into chat messages and a prompt, as vLLM 0.32 does.

Why one package for the server and the capture addon: ``polar-train serve`` builds its prompts with
these conversions (checked against real vLLM by the contract tests), and the addon renders token ids
for calls whose server returned none with the very same code, so a rendered prompt equals the
served one by construction rather than by a second implementation kept in step.

Modules: ``errors`` (request errors in vLLM's shapes), ``lax`` (fields read as pydantic's lax
mode reads them), ``render`` (chat messages + tools → prompt text and ids), ``responses`` (OpenAI
Responses input items and tools), ``anthropic`` (Anthropic Messages). Pure functions, no I/O,
no torch: cheap to import inside mitmproxy.
"""
