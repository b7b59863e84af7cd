"""The engine as a gRPC service (`TokenSpeedScheduler` of smg-grpc-proto), for the `smg` gateway.

`server.py` runs a headless replica (`tokenspeed serve --grpc-port P`),
`service.py` implements the RPCs on top of `AsyncEngine`, `convert.py` maps
the wire to `SamplingParams` and back, `kv_events.py` streams prefix-cache
page events for cache-aware routing, `loads.py` reports load, and
`tokenizer_bundle.py` ships the tokenizer files.
"""
