"""The capture side of polar-train: what the mitmproxy addon (``addons/polar_capture.py``) uses.

One module per concern: ``options`` (the ``polar_`` options), ``identity`` (rollout ids, headers
read once), ``redact`` (secrets out of stored JSON), ``sse`` (incremental event splitter), ``tap``
(the stream tap), ``grammar`` (compact-JSON regexes for the fast strippers), one module per wire
format (``openai_chat``, ``openai_responses``, ``anthropic_messages``), ``render`` (token ids from a
chat template), ``record`` (a call's state -> a call-log row), ``worker`` (the row worker process),
``handoff`` (bounded queues that drop instead of blocking), ``writer`` (Parquet parts) and
``outdir`` (the output folder). Everything except the addon's hooks is plain Python, testable
without mitmproxy.
"""
