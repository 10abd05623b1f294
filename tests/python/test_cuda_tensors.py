"""The logic of attention_client.cuda_tensors that runs without a GPU: the segment registration
cache and the choice between CUDA regions and the host path.

- Against the real attention_server (CPU backend): a CUDA region is refused (UNIMPLEMENTED on the
  cpu backend, FAILED_PRECONDITION without --allow_shared_memory); Client(cuda_regions="auto")
  remembers it (usable turns False: every later call takes the host path), "on" raises, "off"
  never tries, nor does "auto" over several addresses. The CUDA driver cannot run here, so a
  stand-in gives each tensor's segment.
- The cache's bookkeeping over a recording SharedMemory stand-in (registering a CUDA region needs
  a GPU): one registration per segment however often it is used, a segment whose addresses a
  new allocation overlaps (torch freed it) unregistered before the new one is registered, the
  least recently used unregistered at capacity (never one the same call uses), all unregistered
  on close.
The GPU host runs the real thing: bench/torch/cuda_regions_check.py.

Run by ctest (label "python"). Exits 77 (skipped) when grpcio or numpy is missing.
"""
import sys
import unittest

try:
    import grpc
    import numpy  # noqa: F401 (the client needs it)
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)

from test_attention_client import ServerTest

from attention_client import AttentionError, Client
from attention_client._stubs import attention_pb2 as pb
from attention_client.cuda_tensors import CudaRegionsUnavailable, SegmentRegions


class FakeDevice:
    def __init__(self, index):
        self.index = index


class FakeTensor:
    """What SegmentRegions reads of a torch CUDA tensor: its device, address and storage."""

    def __init__(self, ptr, device=0):
        self.device = FakeDevice(device)
        self._ptr = ptr
        self.storage = object()

    def data_ptr(self):
        return self._ptr

    def untyped_storage(self):
        return self.storage


class ForeignTensor:
    """A tensor over memory outside torch's allocator: no storage keeps its segment."""

    def __init__(self, ptr, device=0):
        self.device = FakeDevice(device)
        self._ptr = ptr

    def data_ptr(self):
        return self._ptr


class FakeDriver:
    """Segments as the CUDA driver would report them: (base, size, buffer id) of the allocation
    holding an address; `segments` is a list of (device, base, size, buffer id) to change at
    will (a new allocation: a new buffer id)."""

    def __init__(self, segments):
        self.segments = segments

    queries = 0

    def segment(self, ptr, device):
        self.queries += 1
        for d, base, size, buffer_id in self.segments:
            if d == device and base <= ptr < base + size:
                return base, size, buffer_id
        raise CudaRegionsUnavailable(f"no allocation holds {ptr:#x}")

    def ipc_handle(self, base, device):
        return bytes([base % 251]) * 64


class RecordingClient:
    """The parts of a Client the cache uses, recording Register and Unregister calls."""

    class Stub:
        def __init__(self, log):
            self.log = log

        def Register(self, request, **kwargs):
            self.log.append(("register", request.name, request.device, request.byte_size))
            return pb.RegionInfo(name=request.name, kind="cuda", device=request.device,
                                 byte_size=request.byte_size)

        def Unregister(self, request, **kwargs):
            self.log.append(("unregister", request.name))
            return pb.UnregisterRegionResponse()

    def __init__(self):
        self.log = []
        self._shm_stub = self.Stub(self.log)
        self._regions = []
        self.metadata = None

    def _call(self, method, request, timeout, metadata):
        return method(request)

    def registered(self):
        return [e[1] for e in self.log if e[0] == "register"]

    def unregistered(self):
        return [e[1] for e in self.log if e[0] == "unregister"]


class SegmentCacheTest(unittest.TestCase):
    def test_each_segment_is_registered_once(self):
        client = RecordingClient()
        cache = SegmentRegions(client, driver=FakeDriver([(0, 0x1000, 0x1000, 1),
                                                          (0, 0x4000, 0x800, 2)]))
        for _ in range(5):
            cache.ensure([FakeTensor(0x1000), FakeTensor(0x1400), FakeTensor(0x4100)])
        self.assertEqual(cache.registrations, 2)
        self.assertEqual(len(client._regions), 2)
        self.assertEqual(sorted(e[3] for e in client.log), [0x800, 0x1000])  # whole segments
        # Their regions locate the tensors (what Client.attend sends by reference).
        self.assertEqual(client._regions[0]._cuda_base, 0x1000)
        # Each registered segment holds the storage of the tensor that brought it (torch cannot
        # free the segment under the server) until it is unregistered.
        segments = list(cache._segments.values())
        self.assertTrue(all(s.keep is not None for s in segments))
        cache.close()
        self.assertEqual(sorted(client.unregistered()), sorted(client.registered()))
        self.assertEqual(client._regions, [])
        self.assertTrue(all(s.keep is None for s in segments))

    def test_addresses_seen_in_a_kept_segment_need_no_driver_query(self):
        client = RecordingClient()
        driver = FakeDriver([(0, 0x1000, 0x1000, 1), (0, 0x4000, 0x800, 2)])
        cache = SegmentRegions(client, capacity=1, driver=driver)
        tensors = [FakeTensor(0x1000), FakeTensor(0x1400)]
        cache.ensure(tensors)
        self.assertEqual(driver.queries, 2)
        for _ in range(3):
            cache.ensure(tensors)
        self.assertEqual(driver.queries, 2)
        # Once the segment is unregistered (evicted here), torch may free it: its addresses are
        # asked about again.
        cache.ensure([FakeTensor(0x4000)])
        self.assertEqual(len(client.unregistered()), 1)
        cache.ensure(tensors[:1])
        self.assertEqual(driver.queries, 4)

    def test_a_freed_segment_is_unregistered_when_its_addresses_are_reused(self):
        # Memory outside torch's allocator (no storage keeps it): its owner may free it while it
        # is registered.
        client = RecordingClient()
        driver = FakeDriver([(0, 0x1000, 0x1000, 1), (1, 0x1000, 0x1000, 3)])
        cache = SegmentRegions(client, driver=driver)
        cache.ensure([ForeignTensor(0x1800), ForeignTensor(0x1800, device=1)])
        first, other_device = client.registered()
        # The segment was freed; a larger one now starts below it (overlapping addresses).
        driver.segments[0] = (0, 0x800, 0x2000, 2)
        cache.ensure([ForeignTensor(0x1800)])
        self.assertEqual(client.unregistered(), [first])  # the other device's stays
        self.assertEqual(cache.registrations, 3)
        # The same base and size with another buffer id: a new allocation too.
        driver.segments[0] = (0, 0x800, 0x2000, 4)
        cache.ensure([ForeignTensor(0x900)])
        self.assertEqual(len(client.unregistered()), 2)
        self.assertEqual(len(client._regions), 2)
        self.assertNotIn(other_device, client.unregistered())

    def test_capacity_evicts_the_least_recently_used_but_not_one_the_call_uses(self):
        client = RecordingClient()
        driver = FakeDriver([(0, 0x10000 * (i + 1), 0x1000, i) for i in range(6)])
        cache = SegmentRegions(client, capacity=3, driver=driver)
        seg = [FakeTensor(0x10000 * (i + 1)) for i in range(6)]
        cache.ensure([seg[0]])
        cache.ensure([seg[1]])
        cache.ensure([seg[2]])
        cache.ensure([seg[0]])  # now seg[1] is the least recently used
        cache.ensure([seg[3]])
        names = client.registered()
        self.assertEqual(client.unregistered(), [names[1]])
        # One call over more segments than the capacity: none it uses is evicted under it.
        cache.ensure([seg[3], seg[4], seg[5], seg[0]])
        live = {r.name for r in client._regions}
        for i in (3, 4, 5, 0):
            located = [r for r in client._regions if r._cuda_base == 0x10000 * (i + 1)]
            self.assertEqual(len(located), 1, f"segment {i}")
            self.assertIn(located[0].name, live)

    def test_a_driver_failure_is_remembered_in_auto_mode(self):
        client = RecordingClient()
        cache = SegmentRegions(client, driver=FakeDriver([]))
        self.assertTrue(cache.usable)
        with self.assertRaises(CudaRegionsUnavailable):
            cache.ensure([FakeTensor(0x1000)])
        self.assertFalse(cache.usable)
        self.assertIn("no allocation", cache.unavailable)
        on = SegmentRegions(client, mode="on", driver=FakeDriver([]))
        with self.assertRaises(CudaRegionsUnavailable):
            on.ensure([FakeTensor(0x1000)])
        self.assertTrue(on.usable)  # "on" never gives up
        self.assertFalse(SegmentRegions(client, mode="off").usable)
        with self.assertRaises(ValueError):
            SegmentRegions(client, mode="sometimes")


def register_one_segment(test, target, **client_args):
    """A Client for `target` whose cache registers one stand-in segment: (client, the
    exception ensure() raised)."""
    client = Client(target, **client_args)
    test.addCleanup(client.close)
    client._cuda_segments._driver = FakeDriver([(0, 0x1000, 0x1000, 7)])
    with test.assertRaises((CudaRegionsUnavailable, AttentionError)) as raised:
        client._cuda_segments.ensure([FakeTensor(0x1000)])
    return client, raised.exception


class RefusingServerTest(ServerTest):
    """The real server (CPU backend) refuses CUDA regions: the Client remembers it."""

    SERVER_FLAGS = ["--allow_shared_memory"]

    def test_cpu_backend_refusal_is_remembered(self):
        client, refused = register_one_segment(self, f"127.0.0.1:{self.port}")
        self.assertIsInstance(refused, CudaRegionsUnavailable)
        self.assertIn("UNIMPLEMENTED", str(refused))
        self.assertFalse(client._cuda_segments.usable)
        self.assertEqual(len(client.list_shared_memory()), 0)

    def test_on_mode_raises_the_refusal(self):
        client, refused = register_one_segment(self, f"127.0.0.1:{self.port}", cuda_regions="on")
        self.assertIsInstance(refused, CudaRegionsUnavailable)
        self.assertTrue(client._cuda_segments.usable)

    def test_unknown_mode_is_refused(self):
        with self.assertRaises(ValueError):
            Client(f"127.0.0.1:{self.port}", cuda_regions="yes")

    def test_several_addresses_do_not_try(self):
        # Regions would be on one server while the calls spread over all of them.
        with Client(f"127.0.0.1:{self.port},127.0.0.1:{self.port}") as client:
            self.assertFalse(client._cuda_segments.usable)
        with Client(f"127.0.0.1:{self.port}") as client:
            self.assertTrue(client._cuda_segments.usable)


class NoSharedMemoryServerTest(ServerTest):
    """A server without --allow_shared_memory: FAILED_PRECONDITION, remembered."""

    def test_refusal_is_remembered(self):
        client, refused = register_one_segment(self, f"127.0.0.1:{self.port}")
        self.assertIsInstance(refused, CudaRegionsUnavailable)
        self.assertIn("FAILED_PRECONDITION", str(refused))
        self.assertFalse(client._cuda_segments.usable)
        # Other errors are the caller's: an unreachable server is not a refusal to remember.
        client, failed = register_one_segment(self, "127.0.0.1:1", timeout=2)
        self.assertIsInstance(failed, AttentionError)
        self.assertEqual(failed.code, grpc.StatusCode.UNAVAILABLE)
        self.assertTrue(client._cuda_segments.usable)


if __name__ == "__main__":
    unittest.main()
