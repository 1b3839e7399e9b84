"""results: a request's outcomes on the wire, and its offset finished.

`translate` turns outcomes into wire records (pure); `delivery` writes them
through a `producer.ProducerPort` (retries, dead letters for a reply topic that
refuses them, offsets finished once acknowledged); `writer.ResultWriter` is the
worker's one entry point. `inflight.InFlight` is a request's one in-flight
record; `detokenize` turns token ids into streamed text. Results takes plain
values (`ResultsOptions`) and a small metrics protocol.
"""
