"""gateway: the OpenAI-compatible HTTP face (`sluice gateway`), a client of the topics
like any other.

- `app.py`: the Starlette app and `serve` — `/v1/chat/completions`,
  `/v1/completions`, `/v1/models`, `/health`, `/ready`; requests go to the model's
  request topic through the SDK's client, events come back on the gateway's own
  reply topic.
- `openai_api.py` (OpenAI's request and response shapes, translated to and from
  sluice's), `openai_errors.py` (sluice's error events as OpenAI's errors, a context
  overflow in OpenAI's words), `openai_stream.py` (server-sent event chunks).
- `responses.py`, `responses_api.py`, `responses_store.py`: the Responses API
  (`/v1/responses`, `previous_response_id` on the session key).
- `openai_batch.py`: OpenAI Batch API lines for `sluice batch --format openai`.
- `readiness.py`: which models have a serving worker now (the heartbeats).

It may import the SDK (`sluice`), `ingest.permissions` (the key check of
`/v1/models`), common and schemas; never `worker`'s insides, `bench` or `cli`.
"""
