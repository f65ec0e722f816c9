#!/usr/bin/env python3
"""The dispatcher's gRPC server, as a client that has no .proto files sees it.

An independent client -- Python grpcio and grpcio-reflection, not tonic --
asks the dispatcher's server reflection for every service, resolves each
one's methods and message types, and then calls `grpc.health.v1.Health/Check`
and `dispatch.v1.NodeService/ListNodes` with messages built only from the
descriptors reflection returned (what `grpcurl` does). A service the server
serves but reflection cannot describe fails here.

Usage: tests/grpc/run-tests BIN_DIR (makes the venv with the pinned client
packages, then runs this file). BIN_DIR holds the built dispatcher.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

import grpc
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

BIN_DIR: Path | None = None
TIMEOUT = 60.0


class Dispatcher:
    """`dispatcher --listen 127.0.0.1:0`: the kernel picks the port, the
    dispatcher prints the address it bound; killed with its group on exit."""

    def __init__(self, tmp: str):
        assert BIN_DIR is not None
        self.log = Path(tmp) / "dispatcher.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [str(BIN_DIR / "dispatcher"), "--listen", "127.0.0.1:0", "--data-dir", f"{tmp}/data"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            m = re.search(r"dispatcher listening on (127\.0\.0\.1:\d+)", self.log.read_text())
            if m:
                self.addr = m.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.close()
        raise AssertionError(f"the dispatcher printed no address:\n{self.log.read_text()[-2000:]}")

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def call(channel: grpc.Channel, pool: descriptor_pool.DescriptorPool, full_service: str, method: str, **fields):
    """A unary call with request and response types taken from `pool`."""
    m = pool.FindServiceByName(full_service).FindMethodByName(method)
    request_type = message_factory.GetMessageClass(m.input_type)
    response_type = message_factory.GetMessageClass(m.output_type)
    stub = channel.unary_unary(f"/{full_service}/{method}", request_serializer=request_type.SerializeToString,
                               response_deserializer=response_type.FromString)
    return stub(request_type(**fields), timeout=TIMEOUT)


class ReflectionTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if BIN_DIR is None:
            raise unittest.SkipTest("no BIN_DIR given") if not os.environ.get("CI") else AssertionError(
                "CI runs this with the built binaries' directory")
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dispatcher = Dispatcher(cls.tmp.name)
        cls.channel = grpc.insecure_channel(cls.dispatcher.addr)
        grpc.channel_ready_future(cls.channel).result(timeout=TIMEOUT)
        cls.db = ProtoReflectionDescriptorDatabase(cls.channel)
        cls.pool = descriptor_pool.DescriptorPool(cls.db)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.dispatcher.close()
        cls.tmp.cleanup()

    def test_every_served_service_is_listed_and_resolves(self):
        services = set(self.db.get_services())
        expected = {"grpc.health.v1.Health", "dispatch.v1.JobService", "dispatch.v1.NodeService",
                    "dispatch.v1.AgentService", "grpc.reflection.v1alpha.ServerReflection"}
        self.assertEqual(expected - services, set(), f"listed: {sorted(services)}")
        for name in sorted(services):
            if name.startswith("grpc.reflection."):
                continue  # tonic serves reflection without describing itself
            with self.subTest(service=name):
                svc = self.pool.FindServiceByName(name)
                self.assertGreater(len(svc.methods), 0)
                for m in svc.methods:
                    # Every request and response type resolves to fields.
                    message_factory.GetMessageClass(m.input_type)
                    message_factory.GetMessageClass(m.output_type)

    def test_health_resolves_and_answers_through_reflection_alone(self):
        health = self.pool.FindServiceByName("grpc.health.v1.Health")
        self.assertEqual(health.file.name, "health.proto")
        self.assertEqual({m.name for m in health.methods}, {"Check", "Watch"})
        serving = health.file.pool.FindEnumTypeByName(
            "grpc.health.v1.HealthCheckResponse.ServingStatus").values_by_name["SERVING"].number
        for service in ("", "dispatch.v1.JobService", "dispatch.v1.NodeService", "dispatch.v1.AgentService"):
            with self.subTest(service=service):
                r = call(self.channel, self.pool, "grpc.health.v1.Health", "Check", service=service)
                self.assertEqual(r.status, serving)
        with self.assertRaises(grpc.RpcError) as unknown:
            call(self.channel, self.pool, "grpc.health.v1.Health", "Check", service="no.such.Service")
        self.assertEqual(unknown.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_a_dispatch_call_through_reflection_alone(self):
        r = call(self.channel, self.pool, "dispatch.v1.NodeService", "ListNodes")
        self.assertEqual(len(r.nodes), 0, "no agent was started")


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        BIN_DIR = Path(sys.argv.pop(1))
    unittest.main(verbosity=2)
