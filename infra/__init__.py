"""infra: the local infrastructure — a real Apache Kafka (KRaft; jars from Maven) and a
real PostgreSQL, started for development, the demo and the tests — and the Helm chart.

- `local.py`: `up`, `down`, `status` of both (`sluice infra ...`); `common.py`: the
  state folder, ports and addresses (`InfraConfig`), the cache folder.
- `kafka_broker.py`: one broker or a cluster of three, plain or secure, started and
  waited for; `kafka_config.py` what a node is made of (jars — `kafka/pom.xml` names
  them —, files, ports, credentials); `kafka_process.py` the nodes as they run
  (which answer, status, stop, purge).
- `postgres.py`: a cluster of its own, run as a non-root user when root. `tls.py`:
  the secure mode's CA and certificates.
- `netns.py`: hosts in network namespaces on a bridge of their own, and the network
  faults between them (nftables: cuts, loss, a bandwidth cap) for the fault run.
- `netns.py`: hosts in network namespaces of their own on one bridge, and the network
  faults between them (nft: partitions, loss, a bandwidth cap) — where `bench chaos
  --networked` runs each node (`InfraConfig.kafka_hosts`, `postgres_host`).
- `helm/`: the chart (workers, gateway, KEDA autoscaling) and its check script.

It imports no other room: the bottom floor, beside `schemas`.
"""
