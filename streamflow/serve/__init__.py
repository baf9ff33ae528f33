"""Kafka-connected real-time serving (MDInference): the model zoo and its labelled evaluation set, the
cloud worker (a faust-streaming app), its model choice policy, the signed request/reply messages, the
device's client and a network shim for measuring.

Modules: ``zoo`` (models with measured accuracy and latency), ``evalset`` (the labelled evaluation set),
``policy`` (pure model choice), ``messages`` (signed requests/replies), ``app`` (the faust worker),
``client`` (the device side: race the cloud against the local model), ``netshim`` (delay/jitter/outage proxy).
Importing this package imports none of faust, Kafka or the engine.
"""
