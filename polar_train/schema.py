"""The two on-disk tables of polar-train, defined once: the call log and the trajectories.

Why one module: the capture addon writes the call log, the builder reads it and writes
trajectories, the trainer reads those. Each imports the schema from here, so a column can only
change in one place, and every reader can check a part against it before trusting its data.
"""

from __future__ import annotations

import pyarrow as pa

CALL_LOG_VERSION = "1"
TRAJECTORY_VERSION = "1"

#: Values of the ``api`` column: one per wire format the addon understands.
APIS = ("openai.chat", "openai.responses", "anthropic.messages")
#: Values of the ``status`` column.
STATUSES = ("ok", "upstream_error", "client_disconnected", "proxy_error")
#: Values of the ``token_source`` column: where the token ids came from.
#: ``server`` - returned by the model server itself (exact); ``rendered`` - the request rendered
#: with the chat template of ``polar_tokenizer`` and the output re-encoded; ``none`` - text only.
TOKEN_SOURCES = ("server", "rendered", "none")

_ts = pa.timestamp("us", tz="UTC")

CALL_LOG_SCHEMA = pa.schema(
    [
        pa.field("call_id", pa.string(), nullable=False),
        pa.field("rollout_id", pa.string()),
        pa.field("rollout_source", pa.string()),  # proxy_auth | header | api_key | listen_port | none
        pa.field("task_id", pa.string()),
        pa.field("api", pa.string(), nullable=False),
        pa.field("method", pa.string()),
        pa.field("host", pa.string()),
        pa.field("path", pa.string()),
        pa.field("model", pa.string()),
        pa.field("attempt", pa.int32()),
        pa.field("request_hash", pa.string()),
        pa.field("client_conn_id", pa.string()),
        # the harness's own session id where it sends one (Codex's session-id header, Claude
        # Code's x-claude-code-session-id): two sessions under one rollout id are told apart
        pa.field("client_session_id", pa.string()),
        pa.field("started_at", _ts),
        pa.field("first_byte_at", _ts),
        pa.field("finished_at", _ts),
        pa.field("stream", pa.bool_()),
        pa.field("http_status", pa.int32()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("request_json", pa.string()),
        pa.field("response_json", pa.string()),
        pa.field("prompt_token_ids", pa.list_(pa.int32())),
        pa.field("completion_token_ids", pa.list_(pa.int32())),
        pa.field("completion_logprobs", pa.list_(pa.float32())),
        pa.field("token_source", pa.string()),
        pa.field("usage_prompt_tokens", pa.int32()),
        pa.field("usage_completion_tokens", pa.int32()),
        pa.field("usage_match", pa.bool_()),
        pa.field("finish_reason", pa.string()),
        pa.field("tool_call_count", pa.int32()),
        pa.field("temperature", pa.float32()),
        pa.field("top_p", pa.float32()),
        pa.field("injected", pa.bool_()),
        # rendered calls: whether the upstream's own /tokenize of the same chat messages gave the
        # same prompt ids (null when not checked; option polar_tokenize_check of the capture addon)
        pa.field("server_tokenize_match", pa.bool_()),
        # Storage of long sessions (see polar_train.calllog): when set, ``prompt_token_ids`` holds
        # only the suffix after the first ``prompt_prefix_len`` tokens of the prompt of call
        # ``prompt_prefix_call_id``, concatenated with that call's completion. Readers resolve it.
        pa.field("prompt_prefix_call_id", pa.string()),
        pa.field("prompt_prefix_len", pa.int32()),
        # The same option stores ``request_json`` compactly: it then holds only the new text, and
        # ``request_json_delta`` says how it interleaves with copies of blocks of the request of
        # call ``request_json_base_call_id`` (triples: copy start, copy length, new characters;
        # see polar_train.text_delta). Readers resolve it.
        pa.field("request_json_base_call_id", pa.string()),
        pa.field("request_json_delta", pa.list_(pa.int32())),
        # ``response_json`` the same way (a Responses reply echoes the instructions and tools)
        pa.field("response_json_base_call_id", pa.string()),
        pa.field("response_json_delta", pa.list_(pa.int32())),
    ],
    metadata={"polar_train.table": "calls", "polar_train.version": CALL_LOG_VERSION},
)

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("rollout_id", pa.string()),
        pa.field("group_id", pa.string()),
        pa.field("task_id", pa.string()),
        pa.field("prompt_ids", pa.list_(pa.int32())),  # the first prompt; never trained
        pa.field("completion_ids", pa.list_(pa.int32())),  # everything after it
        pa.field("loss_mask", pa.list_(pa.int8())),  # 1 = sampled by the model, 0 = tool/template
        pa.field("logprobs", pa.list_(pa.float32())),  # sampler logprob; NaN where not sampled
        pa.field("reward", pa.float64()),
        pa.field("num_calls", pa.int32()),
        pa.field("call_ids", pa.list_(pa.string())),
        pa.field("token_source", pa.string()),
        pa.field("truncated", pa.bool_()),
        pa.field("realigned", pa.bool_()),
        pa.field("fork_cause", pa.string()),  # why this trajectory did not continue an earlier one
        pa.field("model", pa.string()),
        pa.field("temperature", pa.float32()),
    ],
    metadata={"polar_train.table": "trajectories", "polar_train.version": TRAJECTORY_VERSION},
)


#: Text columns that compact storage (``polar_prompt_delta``) may store as a delta of another call's
#: text: each has the two columns :func:`delta_columns` names beside it.
COMPACT_TEXT_COLUMNS = ("request_json", "response_json")


def delta_columns(column: str) -> tuple[str, str]:
    """The columns beside a compact text ``column``: the call it refers to, and the plan."""
    return f"{column}_base_call_id", f"{column}_delta"


#: Call-log columns added after version 1: parts written before them lack them, and readers take
#: them as null - what such a writer meant (it never stored a request compactly).
CALL_LOG_ADDED_COLUMNS = frozenset({*(name for c in COMPACT_TEXT_COLUMNS for name in delta_columns(c)),
                                    "client_session_id"})

#: How ``polar_prompt_delta`` stored a request text for fourteen minutes (2026-12-05 12:58-13:12,
#: polar-train 343a87e..ec6066d): the call it shares text with, how many of that call's first and
#: last characters the text starts and ends with; ``request_json`` held the middle. Parts written
#: then have these columns (and none of the later delta columns): the reader rebuilds their texts
#: from them (taken as the middle alone, a request read back as a fragment, unsaid).
LEGACY_REQUEST_DELTA_COLUMNS = ("request_json_prefix_call_id", "request_json_prefix_len", "request_json_suffix_len")


def same_kind(have: pa.DataType, want: pa.DataType) -> bool:
    """Whether a column of type ``have`` reads as ``want`` without changing its meaning (the
    reader casts it): what pandas writes back from a table it read - ``large_string`` for every
    string, ``double`` for an integer column with nulls, ``null`` for a column of nulls,
    ``large_list`` for lists. A value an integer column cannot keep (2.5) fails the read, named; a
    double read as float32 is rounded (pyarrow does not check its range)."""
    if have.equals(want) or pa.types.is_null(have):
        return True
    if pa.types.is_string(want) or pa.types.is_large_string(want):
        return pa.types.is_string(have) or pa.types.is_large_string(have)
    if pa.types.is_binary(want) or pa.types.is_large_binary(want):
        return pa.types.is_binary(have) or pa.types.is_large_binary(have)
    if pa.types.is_floating(want):
        return pa.types.is_floating(have) or pa.types.is_integer(have)
    if pa.types.is_integer(want):
        return pa.types.is_integer(have) or pa.types.is_floating(have)
    if pa.types.is_timestamp(want):
        return pa.types.is_timestamp(have) and (have.tz is None) == (want.tz is None)
    if pa.types.is_list(want) or pa.types.is_large_list(want):
        return ((pa.types.is_list(have) or pa.types.is_large_list(have) or pa.types.is_fixed_size_list(have))
                and same_kind(have.value_type, want.value_type))
    return False


def missing_columns(schema: pa.Schema, expected: pa.Schema, optional: frozenset[str] = frozenset()) -> list[str]:
    """Names of ``expected`` columns that ``schema`` lacks or types otherwise than :func:`same_kind`
    reads (for clear errors); a column named in ``optional`` may be absent, but not of another type."""
    problems = []
    for field in expected:
        idx = schema.get_field_index(field.name)
        if idx < 0:
            if field.name not in optional:
                problems.append(f"{field.name} (missing)")
        elif not same_kind(schema.field(idx).type, field.type):
            problems.append(f"{field.name} ({schema.field(idx).type}, expected {field.type})")
    return problems
