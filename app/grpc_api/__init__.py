"""The gRPC API: ``llm.proto``, its generated modules (``scripts/gen_grpc.sh``) and the
Ingress's RPC methods (``service.py``)."""

# What Serve's gRPC proxy adds to its server (``grpc_options.grpc_servicer_functions``).
SERVICER_FUNCTION = "app.grpc_api.proxy_fix.add_servicer"
