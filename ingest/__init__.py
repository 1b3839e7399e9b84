"""ingest: reading a model's request topic, and a verdict for every record.

`consumer.RequestIngest` reads (every codec, `read_committed`, unreadable bytes
dead-lettered) and tracks offsets (`offsets`); `checks.RequestChecks` judges
each record — decode, reply topic, model and adapter, permission
(`permissions`, PostgreSQL), prompt (`prompting`) — into a verdict
(`verdicts`: admitted, refused, dead-lettered) that the worker routes. Ingest
takes plain values (`IngestOptions`) and writes nothing itself.
"""
