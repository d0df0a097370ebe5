#!/usr/bin/python3
"""A minimal Python client for bulkhead, using Debian's python3-grpcio and python3-protobuf.

Streams one generation and prints the token ids as they arrive:

  tools/generate_client.py --server 127.0.0.1:50051 --tokens 1,2,3 --max-tokens 16
  tools/generate_client.py --server ... --tokens 1,2,3 --temperature 0.8 --seed 7

The Python stubs are generated from proto/bulkhead/v1/generator.proto at start, with protoc and
grpc_python_plugin (Debian's protobuf-compiler and protobuf-compiler-grpc).
"""
import argparse
import os
import subprocess
import sys
import tempfile

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_stubs(out_dir):
    subprocess.run(
        ["protoc", f"--proto_path={ROOT}/proto", f"--python_out={out_dir}",
         f"--grpc_out={out_dir}", "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
         "bulkhead/v1/generator.proto"],
        check=True)
    sys.path.insert(0, out_dir)
    from bulkhead.v1 import generator_pb2, generator_pb2_grpc  # noqa: E402
    return generator_pb2, generator_pb2_grpc


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--server", required=True)
    p.add_argument("--tokens", required=True, help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as out_dir:
        pb, pb_grpc = load_stubs(out_dir)
        sampling = pb.SamplingParams(temperature=a.temperature)
        if a.seed is not None:
            sampling.seed = a.seed
        request = pb.GenerateRequest(
            prompt_token_ids=[int(t) for t in a.tokens.split(",")],
            max_tokens=a.max_tokens, sampling=sampling, ignore_eos=a.ignore_eos)
        with grpc.insecure_channel(a.server) as channel:
            stub = pb_grpc.GeneratorStub(channel)
            tokens = []
            try:
                for response in stub.Generate(request, timeout=60):
                    tokens.extend(response.token_ids)
                    if response.finish_reason:
                        finish = pb.FinishReason.Name(response.finish_reason)
            except grpc.RpcError as e:
                print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
                return 1
        print(",".join(str(t) for t in tokens))
        print(f"finish {finish}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
