"""Gateway mode: N engine replicas (gRPC, `tokenspeed/grpc/`) behind the `smg` router (`launcher.py`)."""
