"""lorafleet's gRPC API (package lorafleet.v1, service LoRAFleet), served through Ray Serve's gRPC proxy.

lorafleet.proto is the source; lorafleet_pb2.py, lorafleet_pb2_grpc.py and lorafleet_pb2.pyi are
generated from it and committed, so running or calling the service needs only grpcio and protobuf.
After editing the proto, regenerate from the repository root with grpcio-tools 1.62.3 (its code runs
on grpcio >= 1.60 and protobuf >= 4.25; newer grpcio-tools emit stubs that demand newer runtimes):

    python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. \\
        cluster/proto/lorafleet.proto
"""
