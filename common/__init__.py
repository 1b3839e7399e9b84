"""common: what every room may take values from.

The one settings object (`settings`, the environment of CONTRACT.md), the
Kafka clients' options and security (`kafka_security`, `kafka_connect`),
reading without getting stuck (`safe_fetch`), topics (`topics`), the
PostgreSQL pool and migrations (`db`), timeouts, errors and logs. It imports
no other room but `schemas` and `infra` (for the local infrastructure's
addresses).
"""
