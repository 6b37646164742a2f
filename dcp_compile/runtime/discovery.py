"""prepare's discovery trace: Dynamo's FX graph of one forward call, captured on fake
tensors (nothing is executed), with the owner of every model tensor, so that ``prepare``
can find the KV caches in the graph and swap them on the module that holds them.

A model whose KV caches were built on the meta device is traced on meta copies of all
its tensors (``_trace_on_meta``), which are put back afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import torch
from torch import nn

_TOKEN_ARGS = ("tokens", "input_ids", "idx", "token_ids")
_ROW_POSITION_ARGS = ("positions", "position_ids")
_SHARED_POSITION_ARGS = ("input_pos", "cache_position")


class _DiscoveryDone(Exception):
    pass


def default_example_inputs(model: nn.Module, max_batch: int, device: torch.device) -> tuple:
    known = _TOKEN_ARGS + _ROW_POSITION_ARGS + _SHARED_POSITION_ARGS
    params = []
    for p in inspect.signature(model.forward).parameters.values():
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        if p.default is not p.empty and p.name not in known:
            break  # gpt-fast's forward(idx, input_pos=None): a defaulted position still counts
        params.append(p)
    args = []
    for p in params:
        if p.name in _TOKEN_ARGS or p.name in _ROW_POSITION_ARGS:
            args.append(torch.zeros(max_batch, 1, dtype=torch.long, device=device))
        elif p.name in _SHARED_POSITION_ARGS:
            args.append(torch.zeros(1, dtype=torch.long, device=device))
        else:
            names = ", ".join(q.name for q in params)
            raise ValueError(
                f"prepare cannot build a discovery call for {type(model).__name__}.forward({names}): it knows "
                f"token arguments {_TOKEN_ARGS} and position arguments {_ROW_POSITION_ARGS + _SHARED_POSITION_ARGS}, "
                f"not {p.name!r}. Pass example_inputs=(...), the positional arguments of one decode call"
            )
    return tuple(args)


@contextlib.contextmanager
def _forget_traced_sizes():
    """Drop the sizes Dynamo records for automatic dynamic shapes during the discovery
    trace: left behind, they make the model's first real compile (at another size)
    symbolic, which ``dcp.backend`` refuses.  The record is Dynamo's internal
    ``pgo._CODE_STATE``; on a torch without it there is nothing to drop."""
    pgo = getattr(torch._dynamo, "pgo", None)
    before = copy.deepcopy(getattr(pgo, "_CODE_STATE", None))
    try:
        yield
    finally:
        if pgo is not None and getattr(pgo, "_CODE_STATE", None) is not None:
            pgo._CODE_STATE.clear()
            pgo._CODE_STATE.update(before or {})


def trace_graph(model: nn.Module, example_inputs: tuple):
    """Dynamo's FX graph of ``model(*example_inputs)`` and its real inputs; runs nothing."""
    captured = {}

    def capture(gm, inputs, **_):
        captured["gm"], captured["inputs"] = gm, list(inputs)
        raise _DiscoveryDone

    compiled = torch.compile(model, backend=capture, fullgraph=True, dynamic=False)
    try:
        with torch.no_grad(), _forget_traced_sizes():
            compiled(*example_inputs)
    except Exception as error:  # Dynamo wraps the backend's exception
        if "gm" not in captured:
            raise ValueError(
                f"prepare's discovery trace of {type(model).__name__} failed: {error}. The model must trace "
                f"with torch.compile(fullgraph=True) on example_inputs"
            ) from error
    return captured["gm"], captured["inputs"]


def tensor_owners(model: nn.Module) -> dict[int, tuple[str, nn.Module, str]]:
    """id(tensor) -> (qualified name, owning module, attribute name), for buffers and plain
    tensor attributes (gpt-fast keeps ``causal_mask`` as one)."""
    owners = {}
    for mod_name, module in model.named_modules():
        tensors = {a: t for a, t in vars(module).items() if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)}
        tensors.update((a, b) for a, b in module._buffers.items() if b is not None)
        for attr, tensor in tensors.items():
            owners[id(tensor)] = (f"{mod_name}.{attr}" if mod_name else attr, module, attr)
    return owners


def parameter_owners(model: nn.Module, real: dict[int, torch.Tensor] | None = None) -> dict[int, tuple]:
    """id(parameter) -> (qualified name, the real parameter): which weight a graph input
    is.  ``real``: the parameters behind the meta copies a meta trace used."""
    return {id(p): (name, (real or {}).get(id(p), p)) for name, p in model.named_parameters()}


def replace_tensor(module: nn.Module, attr: str, tensor: torch.Tensor) -> None:
    if attr in module._buffers:
        module.register_buffer(attr, tensor, persistent=attr not in module._non_persistent_buffers_set)
    else:
        setattr(module, attr, tensor)


def _tensors(model: nn.Module):
    yield from model.parameters()
    yield from model.buffers()


def _trace_on_meta(model: nn.Module, example_inputs: tuple):
    """``trace_graph`` for a model whose KV caches were built on the meta device.

    Fake tensors cannot mix devices, so every parameter, buffer and tensor attribute is
    swapped for a meta copy for the trace and put back afterwards.  Returns the graph, its
    (meta) inputs and their owners."""
    params, swapped = [], []
    for module in model.modules():
        params += [(module, name, p) for name, p in module._parameters.items() if p is not None]
        for name, buf in module._buffers.items():
            if buf is not None:
                swapped.append((module, name, buf))
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                swapped.append((module, name, value))
    try:
        for module, name, p in params:
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
        for module, name, tensor in swapped:
            replace_tensor(module, name, tensor.to("meta"))
        meta_inputs = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in example_inputs)
        gm, inputs = trace_graph(model, meta_inputs)
        owners = tensor_owners(model)
        weights = parameter_owners(model, real={id(m._parameters[n]): p for m, n, p in params})
    finally:
        for module, name, p in params:
            module._parameters[name] = p
        for module, name, tensor in swapped:
            replace_tensor(module, name, tensor)
    return gm, inputs, owners, weights


def discover(model: nn.Module, forward_args: tuple, defaulted: bool, max_batch: int):
    """The discovery trace of ``model(*forward_args)`` (``defaulted``: arguments prepare
    built from the forward signature): ``(graph, its inputs, owner of each buffer or tensor
    attribute, name and real tensor of each parameter)``, keyed by id of the traced tensor."""
    try:
        if any(t.is_meta for t in _tensors(model)):
            return _trace_on_meta(model, forward_args)
        gm, inputs = trace_graph(model, forward_args)
        return gm, inputs, tensor_owners(model), parameter_owners(model)
    except ValueError as error:
        if not defaulted:
            raise
        raise ValueError(
            f"{error}. prepare called forward with {max_batch} rows (max_batch={max_batch}): if the model's KV "
            f"caches hold another number of rows, build the model for max_batch={max_batch}, or pass "
            f"example_inputs="
        ) from error
