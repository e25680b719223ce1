"""The streams, events, stream capture and CUDA graphs of the simulated device of
tests/sim_cupy.py, as CuPy 14 exposes them (cupy/cuda/stream.pyx, cupy/cuda/graph.pyx) and
CUDA rules them, and the count of its launches.

Every launch of the device goes through `enqueue` on a stream (the current one by default:
``with stream:`` makes a stream current in its thread). Outside a capture it runs at once
and is counted in `launches` under its ``(kind, name)``. While its stream captures
(``stream.begin_capture()`` ... ``graph = stream.end_capture()``) it is recorded instead,
not run, and counted under ``("captured", name)``; ``graph.launch()`` then runs the
recorded launches in their order over the memory as it is then, counted once as
``("graph", "launch")`` (a GPU replays the nodes with no launch from the host). A graph
holds no device memory: it keeps its addresses, as on a GPU.

Capture is CuPy's default mode, relaxed (the only one simulated): the capturing thread may
allocate, and launches on other streams run at once, except on the legacy default stream
while a blocking stream of its device captures (CUDA: that would make the legacy stream wait
for the capture; it fails and invalidates the capture). What is refused in a capture fails
as it fails on a GPU:

- CuPy checks the stream before some calls and raises without calling CUDA, so the capture
  goes on: a cuBLAS call raises NotImplementedError (cupy_backends/cuda/libs/cublas.pyx,
  ``setStream``), a copy between host and device RuntimeError (cupy/cuda/memory.pyx,
  ``copy_to_host_async`` / ``copy_from_host_async``; ``ndarray.get`` and ``set``,
  ``cupy.asarray`` of host data take these). Its check (``runtime.streamIsCapturing``)
  itself raises RuntimeError on an invalidated capture.
- CUDA refuses the rest and invalidates the capture: synchronizing or querying the stream
  or the device, or querying an event recorded in the capture, raise `CUDARuntimeError`
  (status 900, 907); later work on the stream raises status 901 (`CUDADriverError` for a
  kernel, which CuPy launches through the driver) and ``end_capture()`` raises
  `CUDARuntimeError` 901 and ends the capture, as ``cudaStreamEndCapture`` does.

>>> import numpy as np, sim_cupy as cp
>>> x, stream = cp.asarray(np.ones(2)), cp.cuda.Stream(non_blocking=True)
>>> with stream:
...     stream.begin_capture()
...     x *= 2.0
...     graph = stream.end_capture()
>>> x.get().tolist()  # recorded, not run
[1.0, 1.0]
>>> graph.launch(); graph.launch(); x.get().tolist()
[4.0, 4.0]
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable

import fake_cupy

launches: collections.Counter = collections.Counter()  # (kind, name) -> launches, since import

# CUDA's statuses met here: (runtime's name, driver's name, CUDA's description of it).
_STATUSES = {
    401: ("cudaErrorIllegalState", "CUDA_ERROR_ILLEGAL_STATE",
          "the operation cannot be performed in the present state"),
    900: ("cudaErrorStreamCaptureUnsupported", "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
          "operation not permitted when stream is capturing"),
    901: ("cudaErrorStreamCaptureInvalidated", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
          "operation failed due to a previous error during capture"),
    906: ("cudaErrorStreamCaptureImplicit", "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
          "operation would make the legacy stream depend on a capturing blocking stream"),
    907: ("cudaErrorCapturedEvent", "CUDA_ERROR_CAPTURED_EVENT",
          "operation not permitted on an event last recorded in a capturing stream"),
}  # fmt: skip
ILLEGAL_STATE, CAPTURE_UNSUPPORTED, CAPTURE_INVALIDATED, CAPTURE_IMPLICIT, CAPTURED_EVENT = 401, 900, 901, 906, 907

# cupy.cuda.runtime's constants of streams and capture (cupy_backends/cuda/api/runtime.pxd).
RUNTIME_CONSTANTS = {
    "streamDefault": 0, "streamNonBlocking": 1, "streamLegacy": 1, "streamPerThread": 2,
    "streamCaptureModeGlobal": 0, "streamCaptureModeThreadLocal": 1, "streamCaptureModeRelaxed": 2,
    "streamCaptureStatusNone": 0, "streamCaptureStatusActive": 1, "streamCaptureStatusInvalidated": 2,
}  # fmt: skip
_LEGACY = (0, 1)  # the null stream's handle and cudaStreamLegacy
_RELAXED = RUNTIME_CONSTANTS["streamCaptureModeRelaxed"]


class _StatusError(RuntimeError):
    """An error of CUDA's with its `status`, its message ``"<name>: <description>"``."""

    _naming = 0  # which name of `_STATUSES` this API gives

    def __init__(self, status: int) -> None:
        self.status = status
        names = _STATUSES[status]
        super().__init__(f"{names[self._naming]}: {names[2]}")

    def __reduce__(self) -> tuple:
        return (type(self), (self.status,))


class CUDARuntimeError(_StatusError):
    """``cupy.cuda.runtime.CUDARuntimeError(status)``."""

    __module__ = "cupy_backends.cuda.api.runtime"


class CUDADriverError(_StatusError):
    """``cupy.cuda.driver.CUDADriverError(status)``: CuPy launches kernels through the driver."""

    __module__ = "cupy_backends.cuda.api.driver"
    _naming = 1


class _Capture:
    """A capture sequence of a stream: the launches recorded, in order, and its state."""

    def __init__(self, stream: "Stream") -> None:
        self.device = _device_of(stream)
        self.blocking = not stream.is_non_blocking
        self.nodes: list[Callable[[], Any]] = []
        self.state = "active"  # then "invalidated" (by a refused call) or "ended"

    def invalidate(self) -> None:
        if self.state == "active":
            self.state = "invalidated"


_captures: dict[int, _Capture] = {}  # stream handle -> its capture not ended
_streams: "weakref.WeakValueDictionary[int, Stream]" = weakref.WeakValueDictionary()  # handle -> stream


def _device_of(stream: Any) -> int:
    return fake_cupy.runtime.getDevice() if stream.device_id == -1 else stream.device_id


def _handle(stream: Any) -> int:
    return fake_cupy.get_current_stream().ptr if stream is None else stream.ptr


def _legacy_use(error: type, invalidate: bool) -> None:
    """Raises `error` (status 906) if a blocking stream of the current device captures: the
    legacy stream would wait for it. A use that would enqueue work invalidates the capture."""
    device = fake_cupy.runtime.getDevice()
    blocking = [c for c in _captures.values() if c.blocking and c.device == device]
    if blocking:
        for capture in blocking if invalidate else ():
            capture.invalidate()
        raise error(CAPTURE_IMPLICIT)


def _taking(kind: str, handle: int) -> _Capture | None:
    """The capture that takes work of `kind` enqueued on the stream `handle`, or None if the
    work runs now; raises as CUDA does for work it refuses there."""
    error = CUDADriverError if kind in ("kernel", "fill") else CUDARuntimeError
    if handle in _LEGACY:
        _legacy_use(error, invalidate=True)
        return None
    capture = _captures.get(handle)
    if capture is not None and capture.state == "invalidated":
        raise error(CAPTURE_INVALIDATED)
    return capture


def enqueue(kind: str, name: str, work: Callable[[], Any], replay: Callable[[], Any] | None = None,
            stream: Any = None) -> None:
    """A launch of `kind` and `name` on `stream` (the current one by default): `work()` runs
    now and is counted, or, while the stream captures, `replay` (by default `work`) is
    recorded to run at each launch of the graph."""
    capture = _taking(kind, _handle(stream))
    if capture is None:
        work()
        launches[kind, name] += 1
    else:
        capture.nodes.append(work if replay is None else replay)
        launches["captured", name] += 1


def recording(stream: Any = None) -> bool:
    """Whether a launch on `stream` (the current one by default) would now be recorded."""
    capture = _captures.get(_handle(stream))
    return capture is not None and capture.state == "active"


def stream_is_capturing(handle: int) -> bool:
    """``cupy.cuda.runtime.streamIsCapturing(stream)``: raises on an invalidated capture."""
    if handle in _LEGACY:
        _legacy_use(CUDARuntimeError, invalidate=False)  # a query: the capture goes on
        return False
    capture = _captures.get(handle)
    if capture is not None and capture.state == "invalidated":
        raise RuntimeError("the stream was capturing, but an error has invalidated the capture sequence")
    return capture is not None


def refuse_if_capturing(stream: Any, refusal: Exception) -> None:
    """CuPy's check before a call it refuses in a capture: raises `refusal` if `stream` (the
    current one by default) captures, without invalidating the capture."""
    if stream_is_capturing(_handle(stream)):
        raise refusal


def _wait_for(handle: int) -> None:
    """``cudaStreamSynchronize`` / ``cudaStreamQuery``: refused on a capturing stream, whose
    capture it invalidates (the work recorded is not to be run)."""
    if handle in _LEGACY:
        _legacy_use(CUDARuntimeError, invalidate=True)
        return
    capture = _captures.get(handle)
    if capture is not None:
        status = CAPTURE_UNSUPPORTED if capture.state == "active" else CAPTURE_INVALIDATED
        capture.invalidate()
        raise CUDARuntimeError(status)


def device_synchronize() -> None:
    """``cupy.cuda.runtime.deviceSynchronize()``: refused while a stream of the current device
    captures, which invalidates its capture."""
    device = fake_cupy.runtime.getDevice()
    capturing = [c for c in _captures.values() if c.device == device]
    for capture in capturing:
        capture.invalidate()
    if capturing:
        raise CUDARuntimeError(CAPTURE_UNSUPPORTED)


class Stream(fake_cupy.Stream):
    """``cupy.cuda.Stream(null=False, non_blocking=False, ptds=False, priority=None)``; the
    singletons ``Stream.null`` (the legacy default stream) and ``Stream.ptds``."""

    null: "Stream"
    ptds: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False,
                 priority: Any = None) -> None:
        if null or ptds:  # CuPy's handles of these, of device -1 (the current one)
            self.ptr, self.device_id = (0 if null else RUNTIME_CONSTANTS["streamPerThread"]), -1
        else:
            super().__init__()
            _streams[self.ptr] = self
        self._non_blocking = bool(non_blocking) and not (null or ptds)

    is_non_blocking = property(lambda self: self._non_blocking)
    done = property(lambda self: _wait_for(self.ptr) or True)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, fake_cupy.Stream) and self.ptr == other.ptr

    def __hash__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"<Stream {self.ptr} (device {self.device_id})>"

    def synchronize(self) -> None:
        _wait_for(self.ptr)

    def record(self, event: "Event | None" = None) -> "Event":
        event = Event() if event is None else event
        event.record(self)
        return event

    def begin_capture(self, mode: int | None = None) -> None:
        """Begins a capture (CuPy's default mode: relaxed), refused on the legacy stream."""
        if self.ptr in _LEGACY:
            raise RuntimeError("cannot capture on the default (legacy) stream")  # CuPy's own check
        if mode is not None and mode != _RELAXED:
            raise NotImplementedError(f"sim_cupy simulates the relaxed capture mode ({_RELAXED}, CuPy's default) "
                                      f"alone, got mode {mode}")
        if self.ptr in _captures:
            raise CUDARuntimeError(ILLEGAL_STATE)
        _captures[self.ptr] = _Capture(self)

    def end_capture(self) -> "Graph":
        """Ends the capture and returns its graph; an invalidated capture ends with an error.
        Ending where no capture is begun, or beginning one twice, raises status 401 (CUDA
        documents no status for these: the likeliest)."""
        capture = _captures.pop(self.ptr, None)
        if capture is None:
            raise CUDARuntimeError(ILLEGAL_STATE)
        invalidated, capture.state = capture.state == "invalidated", "ended"
        if invalidated:
            raise CUDARuntimeError(CAPTURE_INVALIDATED)
        return Graph._of(capture.nodes)

    def is_capturing(self) -> bool:
        return stream_is_capturing(self.ptr)


Stream.null, Stream.ptds = Stream(null=True), Stream(ptds=True)


def get_current_stream(device_id: int = -1) -> Stream:
    """``cupy.cuda.get_current_stream()``: the stream current in this thread (the device's
    argument is not simulated: the current device's)."""
    handle = fake_cupy.get_current_stream().ptr
    return _streams.get(handle) or (Stream.ptds if handle == Stream.ptds.ptr else Stream.null)


class Event:
    """``cupy.cuda.Event(block=False, disable_timing=False, interprocess=False)``. Every
    launch has run when it returns, so an event never recorded, or recorded outside a
    capture, is done. Recording one on a capturing stream is allowed (CUDA uses it for the
    order of work across streams; it adds nothing to the graph), but then querying or
    synchronizing it raises `CUDARuntimeError` 907, invalidating the capture if it has not
    ended, until it is recorded outside a capture again. (That the query invalidates the
    capture follows CUDA's rule for invalid calls in a capture; that the event stays
    unusable after the capture ended is the likeliest reading of the status' name: CUDA
    documents neither.)"""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        if interprocess and not disable_timing:
            raise ValueError("Timing must be disabled for interprocess events")
        self._capture: _Capture | None = None  # the capture it was last recorded in

    def record(self, stream: Any = None) -> None:
        self._capture = _taking("event", _handle(stream))

    @property
    def done(self) -> bool:
        self.synchronize()
        return True

    def synchronize(self) -> None:
        if self._capture is not None:
            self._capture.invalidate()
            raise CUDARuntimeError(CAPTURED_EVENT)


class Graph:
    """``cupy.cuda.Graph``, made by ``Stream.end_capture()`` only: its launches, replayed in
    order by ``launch(stream=None)`` (on the current stream by default; recorded as one
    node where that stream captures)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("currently this class cannot be initiated by the user and must be created via "
                                  "stream capture")

    @classmethod
    def _of(cls, nodes: list[Callable[[], Any]]) -> "Graph":
        graph = cls.__new__(cls)
        graph._nodes = tuple(nodes)
        return graph

    def launch(self, stream: Any = None) -> None:
        enqueue("graph", "launch", self._replay, stream=stream)

    def upload(self, stream: Any = None) -> None:
        """Uploads the graph to the device ahead of its first launch: here nothing to do."""

    def _replay(self) -> None:
        for node in self._nodes:
            node()
