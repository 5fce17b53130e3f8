"""What the backward's recompute replays from the forward: each half's random draws (from generators
of its own, forked from the global ones) and the autocast settings (DESIGN.md section 5)."""
from __future__ import annotations

import contextlib
import inspect
import threading
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from ..halves.randomness import HalfGenerators, default_generator, device_key


# The torch functions that draw random numbers, by name, as the routing mode (a TorchFunctionMode)
# meets them: what a half calls, a torch function or a Tensor method, not the aten ops inside it.
# Every aten op that draws (tagged nondeterministic_seeded or taking a generator; a test holds the list
# to the installed torch's), under its own name or a Tensor method's: torch.dropout, Tensor.bernoulli_...
RANDOM_ATEN_OPS = frozenset({
    "_cudnn_attention_backward", "_cudnn_attention_forward", "_cudnn_init_dropout_state", "_cudnn_rnn",
    "_efficient_attention_forward", "_fill_mem_eff_dropout_mask_", "_flash_attention_forward",
    "_flash_attention_forward_no_dropout_inplace", "_fused_dropout", "_fused_sdp_choice", "_lstm_mps",
    "_nested_tensor_softmax_with_shape", "_sample_dirichlet", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_attention_math_for_mps", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable",
    "_standard_gamma", "_triton_scaled_dot_attention", "alpha_dropout", "alpha_dropout_", "bernoulli",
    "bernoulli_", "binomial", "cauchy", "cauchy_", "dropout", "dropout_", "exponential", "exponential_",
    "feature_alpha_dropout", "feature_alpha_dropout_", "feature_dropout", "feature_dropout_", "geometric",
    "geometric_", "gru", "log_normal", "log_normal_", "lstm", "miopen_rnn", "multinomial", "native_dropout",
    "normal", "normal_", "normal_functional", "poisson", "rand", "rand_like", "randint", "randint_like", "randn",
    "randn_like", "random", "random_", "randperm", "rnn_relu", "rnn_tanh", "rrelu", "rrelu_", "rrelu_with_noise",
    "rrelu_with_noise_", "rrelu_with_noise_functional", "scaled_dot_product_attention", "uniform", "uniform_",
})
# torch's Python functions that draw inside (torch.nn.functional, torch.nn.init): the mode meets them and
# not the calls they make, so they are routed whole.
RANDOM_PYTHON_FUNCTIONS = frozenset({
    "dropout1d", "dropout2d", "dropout3d", "gumbel_softmax", "multi_head_attention_forward",
    "fractional_max_pool2d", "fractional_max_pool3d", "fractional_max_pool2d_with_indices",
    "fractional_max_pool3d_with_indices", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
    "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
})
RANDOM_FUNCTIONS = RANDOM_ATEN_OPS | RANDOM_PYTHON_FUNCTIONS

_ROUTES: dict = {}  # a random torch function -> its _Route


class _Route:
    """How a random function (a name in RANDOM_FUNCTIONS) gets a half's generator: its ``generator``
    argument where it takes one (``torch.rand``, ``Tensor.bernoulli_``, ``nn.init.uniform_``), else
    the global generator swapped for the half's around the one call (``dropout``, SDPA, the RNNs:
    ``swap``). Such functions say by an argument whether they draw at all (SDPA's ``dropout_p``,
    ``dropout``'s ``p`` and ``train`` / ``training``): a call with a zero rate or training False
    draws nothing and passes (so a half whose dropouts are at 0 or in eval mode draws nothing)."""

    def __init__(self, func):
        readings, takes_generator = _signatures(func)
        self.swap = not takes_generator
        # Per reading of the call (a builtin's overloads may put an argument at other positions: the call
        # draws if any reading says so), the (position or None, name, default) of the arguments that tell.
        self.readings = [([a for a in arguments if a[1] in ("p", "dropout_p", "dropout")],
                          [a for a in arguments if a[1] in ("train", "training")]) for arguments in readings]

    def draws(self, args, kwargs) -> bool:
        def value(i, name, default):
            if name in kwargs:
                return kwargs[name]
            return args[i] if i is not None and i < len(args) else default

        def reading_draws(rates, train) -> bool:
            return not (any(value(*a) == 0 for a in rates) or any(value(*a) is False for a in train))

        return not self.readings or any(reading_draws(*reading) for reading in self.readings)


def _signatures(func):
    """``(readings, takes_generator)`` of a random function: each reading a list of its arguments'
    ``(position or None for keyword-only, name, default)``: its Python signature, or a builtin's
    overloads (of the aten op of its name) with distinct positions; none for an unknown function."""
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        parameters = None
    if parameters is not None:
        arguments = [(None if p.kind == p.KEYWORD_ONLY else i, p.name, None if p.default is p.empty else p.default)
                     for i, p in enumerate(parameters)]
        return [arguments], any(p.name == "generator" for p in parameters)
    packet = getattr(torch.ops.aten, getattr(func, "__name__", ""), None)
    if packet is None or not hasattr(packet, "overloads"):
        return [], False
    readings = []
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema.arguments
        arguments = [(None if a.kwarg_only else i, a.name, a.default_value if a.has_default_value() else None)
                     for i, a in enumerate(schema)]
        if arguments not in readings:
            readings.append(arguments)
    return readings, any(a[1] == "generator" for arguments in readings for a in arguments)


def _route(func) -> _Route | None:
    """The route of ``func`` if it draws random numbers, else None (one name lookup: every torch call of
    a routed half comes here)."""
    if getattr(func, "__name__", None) not in RANDOM_FUNCTIONS:
        return None
    route = _ROUTES.get(func)
    if route is None:
        route = _ROUTES[func] = _Route(func)
    return route


def _device_of(args, kwargs) -> torch.device | None:
    device = kwargs.get("device")
    if device is None:
        for arg in args:
            if isinstance(arg, torch.Tensor):
                return device_key(arg.device)
        return device_key(torch.get_default_device())
    return device_key(device)


_in_routed_call = threading.local()  # .on: a routing mode is running one call (enclosing modes let it be)


class _RoutedToHalf(TorchFunctionMode):
    """Hands a half's generators (:class:`HalfGenerators`) to the random functions its code calls
    with none (``nn.Dropout``, ``torch.rand_like``, a timm ``DropPath``'s ``bernoulli_``). A torch
    function mode: it meets each torch function and Tensor method the half calls (the torch function
    protocol, into Python and back: about 25 us a call on a 2-core CPU; a name lookup for the calls
    that draw nothing), not each aten op inside them, which a dispatch mode did at about 20 us an op,
    several ops a call. A random function whose draws cannot be handed a generator this way (an
    extension's op drawing from the global generator) is seen by the probe (:class:`GlobalStart`).
    Mode stacks are per thread: another thread's draws never come here. ``routed``: whether any
    call was routed."""

    def __init__(self, half: HalfGenerators):
        super().__init__()
        self.half = half
        self.routed = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = _route(func)
        if route is None or getattr(_in_routed_call, "on", False) or not route.draws(args, kwargs):
            return func(*args, **kwargs)
        if kwargs.get("generator") is not None or any(isinstance(a, torch.Generator) for a in args):
            return func(*args, **kwargs)  # (a generator the half chose: its own)
        device = _device_of(args, kwargs)
        if device is None:
            return func(*args, **kwargs)
        self.routed = True
        generator = self.half.generator(device)
        _in_routed_call.on = True  # what this call runs inside is not routed again by an enclosing half
        try:
            if route.swap:
                return _with_global_generator(device, generator, func, args, kwargs)
            return func(*args, **{**kwargs, "generator": generator})  # (in place of a generator=None)
        finally:
            _in_routed_call.on = False


def _with_global_generator(device, generator, func, args, kwargs):
    """``func`` (a random op with no ``generator`` argument) drawing from ``generator``: the global
    generator's state swapped for it around the call only (another thread drawing from the global
    generator during this one call would see the half's state)."""
    default = default_generator(device)
    if generator is default:  # (a captured forward's half draws from the global generator itself)
        return func(*args, **kwargs)
    if device.type == "cuda":  # graph-safe: the generator shares ``generator``'s state for the call
        saved = default.graphsafe_get_state()
        default.graphsafe_set_state(generator)
        try:
            return func(*args, **kwargs)
        finally:
            default.graphsafe_set_state(saved)
    saved = default.get_state()
    default.set_state(generator.get_state())
    try:
        return func(*args, **kwargs)
    finally:
        generator.set_state(default.get_state())
        default.set_state(saved)


def _set_generator(target: torch.Generator, state: torch.Generator):
    # In place: the target keeps its state object (a CUDA graph may have registered the global one's)
    target.set_state(state.get_state())


class GlobalStart:
    """The global generators' states at a half's start (the CPU's, and the current CUDA device's once
    CUDA is initialised): the replay of draws the routing cannot reach, as the state tape before
    the half's own generators did. A random op with no random tag that draws from the global
    generator inside (a custom op or extension kernel: flash-attn's dropout) passes the routing
    mode; the probe sees the global generator move under a routed half and records such a half
    this way (its routed draws still from its own generators) for as long as it keeps moving. The
    escaped draws are not safe against another thread drawing during the step."""

    def __init__(self):
        devices = [torch.device("cpu")]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices.append(torch.device("cuda", torch.cuda.current_device()))
        self.states = {device: default_generator(device).clone_state() for device in devices}

    def moved(self) -> bool:
        """Whether a global generator drew since (compares the states on the host: the probe, and each
        forward of a half seen escaping, only)."""
        for device, state in self.states.items():
            now = default_generator(device)
            if device.type == "cuda":
                if (now.initial_seed(), now.get_offset()) != (state.initial_seed(), state.get_offset()):
                    return True
            elif not torch.equal(now.get_state(), state.get_state()):
                return True
        return False

    @contextlib.contextmanager
    def replayed(self):
        """The global generators at the recorded start for the recompute, the caller's restored after."""
        saved = {device: default_generator(device).clone_state() for device in self.states}
        for device, state in self.states.items():
            _set_generator(default_generator(device), state)
        try:
            yield
        finally:
            for device, state in saved.items():
                _set_generator(default_generator(device), state)


ESCAPED_DRAW_MESSAGE = ("revtriton: a half's random draws are {} and cannot be captured in a CUDA graph: a "
                        "captured half draws from generators the graph registers (halves.randomness.GraphDraws)")


@dataclass(frozen=True)
class HalfDraws:
    """What one half call drew: its generators' start states, whether its draws needed routing (code
    that draws with no generator) or all asked for the half's (``halves.randomness``), and the global
    generators' start when some draws escaped the routing (:class:`GlobalStart`)."""

    start: dict
    routed: bool
    global_start: GlobalStart | None = None

    @property
    def kind(self) -> str:
        """How later forwards record the half: "global", "routed" or "own"."""
        return "global" if self.global_start is not None else "routed" if self.routed else "own"


class HalfRandomness:
    """Runs a half's forward on generators of its own and replays them in its recompute.

    :meth:`recorded` runs the forward on generators forked from the global ones at its first draw,
    then sets the global ones past those draws (the masks and the global stream are those of a plain
    run); :meth:`replayed` runs the recompute from the recorded start. Which halves draw, and how,
    is probed once (the stack's plan keeps it): a half known to draw nothing runs as it is and
    records nothing (a step of a stack whose halves draw nothing reads no RNG state), one whose
    draws all ask for the half's generator runs with no routing mode, one whose draws escaped the
    routing is recorded by the global generators' state (:class:`GlobalStart`).
    """

    @staticmethod
    @contextlib.contextmanager
    def recorded(sink: list, kind: str | None = None, routing: bool = True):
        """Run a half's forward; appends to ``sink`` its :class:`HalfDraws` (None: it drew nothing).
        ``kind``: how the half draws, from an earlier probe (:attr:`HalfDraws.kind`), or None: probe.
        ``routing`` False: never under the routing mode (its draws with no generator are then
        recorded by the global generators' state)."""
        # The probe, and every forward of a half seen escaping, compare the global generators' states
        # around the half: another thread drawing during the half looks the same as an escape, so a
        # half is recorded by its global start only while the global generator keeps moving under it.
        unrecordable = kind is None or kind == "global"  # (a graph cannot compare the global states)
        if unrecordable and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(ESCAPED_DRAW_MESSAGE.format(
                "not known yet (no eager call of the step came first)" if kind is None else
                "drawn where the engine cannot hand them a generator (an extension kernel reading the global one, "
                "such as flash-attn's dropout)"))
        global_start = GlobalStart() if kind is None or kind == "global" else None
        routed = routing and kind != "own"
        with HalfGenerators() as half, (_RoutedToHalf(half) if routed else _NO_ROUTING) as mode:
            yield
        escaped = global_start is not None and global_start.moved()
        half.advance_source()
        drew = half.start or escaped
        sink.append(HalfDraws(half.start, routed and mode.routed, global_start if escaped else None) if drew else None)

    @staticmethod
    def replayed(draws: HalfDraws | None):
        """Run a half's recompute drawing the forward's numbers (``draws`` None: it draws nothing)."""
        if draws is None:
            return _NO_ROUTING
        if draws.global_start is not None:
            return _replayed_with_global_start(draws)
        half = HalfGenerators(draws.start)
        return _routed(half) if draws.routed else half


@contextlib.contextmanager
def _routed(half: HalfGenerators):
    with half, _RoutedToHalf(half):
        yield


@contextlib.contextmanager
def _replayed_with_global_start(draws: HalfDraws):
    with draws.global_start.replayed(), HalfGenerators(draws.start) as half:
        with _RoutedToHalf(half) if draws.routed else _NO_ROUTING:
            yield


_NO_ROUTING = contextlib.nullcontext()


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings of the forward, restored around every recompute."""

    settings: tuple

    @staticmethod
    def capture():
        settings = []
        for device_type in ("cpu", "cuda"):
            enabled = torch.is_autocast_enabled(device_type)
            dtype = torch.get_autocast_dtype(device_type)
            settings.append((device_type, enabled, dtype))
        return AutocastState(tuple(settings))

    @contextlib.contextmanager
    def restored(self):
        with contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in self.settings:
                if device_type == "cuda" and not torch.cuda.is_available():
                    continue
                if torch.is_autocast_enabled(device_type) == enabled and (
                        not enabled or torch.get_autocast_dtype(device_type) == dtype):
                    continue  # already as the forward had it (the common case): nothing to enter
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield
