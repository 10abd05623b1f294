"""The logic of attention_client.cuda_tensors that runs without a GPU: the segment registration
cache and the choice between CUDA regions and the host path.

- Against the real attention_server (CPU backend): a CUDA region is refused (UNIMPLEMENTED on the
  cpu backend, FAILED_PRECONDITION without --allow_shared_memory); Client(cuda_regions="auto")
  remembers it (usable turns False: every later call takes the host path), "on" raises, "off"
  never tries, nor does "auto" over several addresses. The CUDA driver cannot run here, so a
  stand-in gives each tensor's segment.
- A decode loop's Step in stream order by counters, serialised from its kept plan: the bytes
  parse as the protobuf-built request, for every combination of layer, k and v, lse and options;
  a plan is kept per batch and shapes and forgotten with the batch.
- The cache's bookkeeping over a recording SharedMemory stand-in (registering a CUDA region needs
  a GPU): one registration per segment however often it is used, a segment whose addresses a
  new allocation overlaps (torch freed it) unregistered before the new one is registered, the
  least recently used unregistered at capacity (never one the same call uses), all unregistered
  on close.
The GPU host runs the real thing: bench/torch/cuda_regions_check.py.

Run by ctest (label "python"). Exits 77 (skipped) when grpcio or numpy is missing.
"""
import math
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
from attention_client import cuda_tensors
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
            found = cache.ensure([FakeTensor(0x1000), FakeTensor(0x1400), FakeTensor(0x4100)])
            # Each tensor's segment, in order (what a Step's references are made from).
            self.assertEqual([s.base for s in found], [0x1000, 0x1000, 0x4000])
            self.assertIs(found[0].region, found[1].region)
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


class ShapedTensor(FakeTensor):
    """A FakeTensor with what a Step's request reads: shape, dtype, size."""

    def __init__(self, ptr, shape, dtype="float16"):
        super().__init__(ptr)
        self.shape = tuple(shape)
        self.dtype = numpy.dtype(dtype)

    def numel(self):
        return math.prod(self.shape)

    def element_size(self):
        return self.dtype.itemsize


class FakeSession:
    def __init__(self, client, id):
        self._client, self.id = client, id

    def _live_id(self):
        return self.id


class CounterPlanTest(unittest.TestCase):
    """_step_by_counters' request, made from a plan kept per batch: equal to the protobuf-built
    one (the fields every call repeats, serialised once, then the call's own); and the request of
    the same Step ordered by events (_device_request)."""

    def setUp(self):
        self.client = RecordingClient()
        self.client._batch_ids = {}
        self.sessions = [FakeSession(self.client, f"r1.s{i}") for i in range(3)]
        region = pb.RegionInfo(name="torch-1-cuda0-a000-0")
        self.segment = cuda_tensors._Segment(0, 0xA000, 0x10000, 1, region, None)
        counters_region = pb.RegionInfo(name="torch-1-cuda0-f000-1")
        self.counter_segment = cuda_tensors._Segment(0, 0xF000, 0x1000, 2, counters_region, None)
        # A thread's _StepCounters as the plan reads them: ready at 0x40 of their segment.
        self.counters = type("Counters", (), {"tensor": FakeTensor(0xF040)})()

    def built(self, q, k, v, o, lse, options, value):
        """The request as protobuf builds it (the fields of _device_request, the counters)."""
        from attention_client.session import _packed_request
        request = _packed_request(self.client, self.sessions, **options)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t is not None:
                tensor = getattr(request, name)
                tensor.dtype = pb.DTYPE_FLOAT16
                tensor.shape.extend(t.shape)
                tensor.ref.CopyFrom(self.ref(t))
        request.o_ref.CopyFrom(self.ref(o))
        if lse is not None:
            request.lse_ref.CopyFrom(self.ref(lse))
        for counter, offset in ((request.ready_counter, 0x40), (request.done_counter, 0x48)):
            counter.ref.CopyFrom(pb.TensorRef(region=self.counter_segment.region.name,
                                              offset=offset, byte_size=8))
            counter.value = value
        return request

    def ref(self, t):
        return pb.TensorRef(region=self.segment.region.name, offset=t.data_ptr() - 0xA000,
                            byte_size=t.numel() * t.element_size())

    def planned(self, q, k, v, o, lse, options, value):
        from attention_client.session import _batch
        plan = cuda_tensors._counter_plan(
            self.client, self.sessions, _batch(self.client, self.sessions), q, k, v, lse,
            self.counter_segment, self.counters, options)
        segments = [self.segment if t is not None else None for t in (q, k, v, o, lse)]
        data = plan.request(options.get("layer"), (q, k, v, o, lse), segments, value)
        return plan, pb.StepRequest.FromString(data.SerializeToString())

    def test_the_planned_request_is_the_protobuf_built_one(self):
        q = ShapedTensor(0xA000, (3, 8, 1, 64))
        k, v = ShapedTensor(0xB000, (3, 2, 1, 64)), ShapedTensor(0xB400, (3, 2, 1, 64))
        o = ShapedTensor(0xC000, (3, 8, 1, 64))
        lse = ShapedTensor(0xD000, (3, 8, 1), "float32")
        for options in (dict(causal=True, layer=0), dict(causal=True, layer=15),
                        dict(layer=None), dict(causal=True, softmax_scale=0.125, window_left=7,
                                               window_right=0, softcap=30.0, chunk_size=64,
                                               request_id="r", layer=3),
                        dict(causal=True, return_lse=True, layer=200)):
            for kv in ((k, v), (None, None)):
                for value in (1, 2, 1 << 40):
                    with_lse = lse if options.get("return_lse") else None
                    _, got = self.planned(q, *kv, o, with_lse, options, value)
                    want = self.built(q, *kv, o, with_lse, options, value)
                    what = f"{options} k={kv[0] is not None} value={value}"
                    self.assertEqual(got, want, what)
                    # The same Step ordered by events (built through protobuf, no counters).
                    segments = [self.segment if t is not None else None
                                for t in (q, *kv, o, with_lse)]
                    by_events = cuda_tensors._device_request(
                        self.client, self.sessions, q, *kv, o, with_lse, segments, options)
                    for field in ("ready_counter", "done_counter"):
                        want.ClearField(field)
                    self.assertEqual(by_events, want, what)

    def test_a_plan_is_kept_per_batch_shapes_and_options_and_forgotten_with_the_batch(self):
        q, o = ShapedTensor(0xA000, (3, 8, 1, 64)), ShapedTensor(0xC000, (3, 8, 1, 64))
        first, _ = self.planned(q, None, None, o, None, dict(causal=True, layer=0), 1)
        again, got = self.planned(ShapedTensor(0xA800, (3, 8, 1, 64)), None, None, o, None,
                                  dict(causal=True, layer=5), 2)
        self.assertIs(again, first)  # another layer and other addresses: the same plan
        self.assertEqual(got.q.ref.offset, 0x800)
        other, _ = self.planned(q, None, None, o, None, dict(causal=False, layer=0), 3)
        self.assertIsNot(other, first)
        wider, _ = self.planned(ShapedTensor(0xA000, (3, 8, 2, 64)), None, None, o, None,
                                dict(causal=True, layer=0), 4)
        self.assertIsNot(wider, first)
        # Sinks are not compared: planned every call.
        sinks = dict(causal=True, layer=0, sinks=[0.5] * 8)
        self.assertIsNot(self.planned(q, None, None, o, None, sinks, 5)[0],
                         self.planned(q, None, None, o, None, sinks, 6)[0])
        self.client._batch_ids.clear()  # what Session.drop does
        self.assertIsNot(self.planned(q, None, None, o, None, dict(causal=True, layer=0), 7)[0],
                         first)


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
