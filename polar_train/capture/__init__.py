"""The capture side of polar-train: what the mitmproxy addon (``addons/polar_capture.py``) uses.

One module per concern: ``options`` (the ``polar_`` options), ``identity`` (rollout ids),
``redact`` (secrets out of stored JSON), ``sse`` (incremental event splitter), one module per wire
format (``openai_chat``, ``openai_responses``, ``anthropic_messages``), ``render`` (token ids from a
chat template), ``record`` (a finished call -> a call-log row) and ``writer`` (Parquet parts on a
worker thread). Everything except the addon's hooks is plain Python, testable without mitmproxy.
"""
