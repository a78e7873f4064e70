"""Triton's compiler on vispe's kernels for a Hopper GPU, no GPU needed: in a child process, because the test session
builds Triton's functions for its interpreter (tests/conftest.py), which its compiler cannot take. And which arguments
a kernel writes, as PyTorch reads it from the kernel's Triton IR when it compiles a graph around the kernel (in a child,
for a Hopper target) and as the test session reads it from the source (where no GPU driver gives PyTorch a target)."""
from __future__ import annotations

import ast
import collections
import json
import os
import subprocess
import sys
import textwrap

from child_python import FAST_EXIT

_CHILD = FAST_EXIT + """
import importlib, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
module = importlib.import_module(sys.argv[1])


def as_inductor_writes_it(kernel):
    # the source a compiled graph's generated code holds for a user kernel: the kernel and every jit function it
    # calls, collected by inductor, under Triton's imports; loaded as a module of its own
    import importlib.util, os, tempfile
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code as closure
    text = "import triton\\nimport triton.language as tl\\n\\n\\n@triton.jit\\n" + closure(kernel)
    path = os.path.join(tempfile.mkdtemp(), kernel.fn.__name__ + "_inductor.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(kernel.fn.__name__ + "_inductor", path)
    emitted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emitted)
    return getattr(emitted, kernel.fn.__name__)


ptx = []
for plan in json.loads(sys.stdin.read()):
    kernel = as_inductor_writes_it(getattr(module, plan["kernel"]))
    names = kernel.arg_names
    signature = {n: plan["types"].get(n, "constexpr" if n in plan["constexprs"] else "i32") for n in names}
    aligned = [i for i, n in enumerate(names) if n in plan["aligned"] or n.endswith(tuple(plan.get("aligned_suffixes", ())))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(fn=kernel, signature=signature, attrs=attrs, constexprs=plan["constexprs"])
    ptx.append(compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
print(json.dumps(ptx))
"""


def hopper_ptx(module: str, plans: list[dict]) -> list[str]:
    """The PTX of each plan's kernel of ``module`` compiled for sm_90, from the source inductor writes for it into a
    compiled graph (the kernel and the jit functions it calls, collected). A plan: ``kernel`` (its name), ``types`` (Triton
    types of the pointer and float arguments; others are ``i32``), ``aligned`` (arguments Triton's launcher would see
    as multiples of 16; optional ``aligned_suffixes``: those whose names end so), ``constexprs`` (every compile-time argument's value)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _CHILD, module], input=json.dumps(plans), capture_output=True,
                          text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def stored_arguments(source: str, names: list[str]) -> list[str] | None:
    """The arguments among ``names`` a kernel's ``source`` writes: ``tl.store`` / ``tl.atomic_*`` into an argument's
    pointer or into a local one offset from it (``rows = dterm + i``; ``src, dst = a + i, b + i``); ``None`` where a
    store's pointer resolves to no argument."""

    def base(node):  # the name a pointer expression starts from: ``out + offsets`` -> ``out``
        while isinstance(node, ast.BinOp):
            node = node.left
        return node.id if isinstance(node, ast.Name) else None

    tree = ast.parse(textwrap.dedent(source))
    aliases = collections.defaultdict(set)  # local name -> the names it is offset from
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) else [(target, value)]
            for t, v in pairs:
                if isinstance(t, ast.Name) and base(v) is not None:
                    aliases[t.id].add(base(v))

    def resolve(name, seen=()):  # a local pointer through its chain of offsets to arguments
        if name in names or name not in aliases or name in seen:
            return {name}
        return set().union(*(resolve(b, (*seen, name)) for b in aliases[name]))

    stores = [node.args[0] for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and (node.func.attr == "store" or node.func.attr.startswith("atomic_")) and node.args]
    targets = set().union(*(resolve(base(p)) for p in stores)) if stores else set()
    return sorted(targets) if targets <= set(names) else None


_ANALYSIS_CHILD = FAST_EXIT + """
import importlib, inspect, json, sys
import torch, triton
from triton.backends.compiler import GPUTarget

class HopperTarget:  # what PyTorch asks Triton's driver for; no GPU here
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

triton.runtime.driver.set_active(HopperTarget())
import torch._higher_order_ops.triton_kernel_wrap as wrap
module = importlib.import_module(sys.argv[1])
out = {}
for name, plan in json.loads(sys.stdin.read()).items():
    kernel = getattr(module, name.split(":")[0])
    args = {}
    for n in kernel.arg_names:
        if n in plan["tensors"]:
            args[n] = torch.zeros(64, dtype=getattr(torch, plan["tensors"][n]))
        else:
            args[n] = plan["constexprs"].get(n, 16)
    if hasattr(wrap, "identify_accessed_tensors"):  # torch >= 2.12
        written = [d.name for d in wrap.identify_accessed_tensors(kernel, args, {}).read_writes.writes]
    else:
        written = wrap.identify_mutated_tensors(kernel, args, {})
    out[name] = sorted(written)
print(json.dumps(out))
"""


def pytorch_written_arguments(module: str, plans: dict[str, dict]) -> dict[str, list[str]]:
    """Per plan, the arguments PyTorch's analysis of its kernel's Triton IR finds written, for a Hopper target. Keys:
    the kernel's name in ``module``, optionally ``:`` and a label. A plan: ``tensors`` (argument name: torch dtype name), ``constexprs`` (compile-time values)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _ANALYSIS_CHILD, module], input=json.dumps(plans), capture_output=True,
                          text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "assuming every input is mutated" not in done.stderr, done.stderr[-4000:]
    return json.loads(done.stdout)
