"""sluice: a Kafka-native LLM inference engine. The public face: SDK, CLI, control plane."""

__version__ = "0.1.0"
