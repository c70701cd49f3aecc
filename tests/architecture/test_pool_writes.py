"""Every write into the KV pool's K and V tensors happens inside the pool's own methods (kvtui/engine/kv_pool.py).

The pool zeroes what a shared attention call reads past a row's length (KVPool.clear_tails), and to know
when to zero again it must see every write: a write past an owner's length (a fault's pads, a step that
writes into another request's slot) puts back what the zeroing took away. So the forward's writes go
through `write`, block copies through `copy_prefix` / `copy_block`, the offload tier's restores through
`restore_block`. This test scans kvtui/ with ast and fails on a write into a pool tensor anywhere else:
a subscript assignment, an in-place method (`copy_`, `fill_`, `index_put_`, `zero_`, ...), an `out=`
argument or a `.data` assignment, on `<...pool>.keys` / `.values`, on a name bound from them (a loop over
`zip(pool.keys, pool.values)`, `k = pool.keys[layer]`, a view or method chain of those), on a parameter
named `pool_*`, or on what `own_keys` (a view of the pool) returns. The scan is flow-insensitive and errs on
the side of flagging: a write into a copy made from the pool by a method chain is flagged too (take the
copy with `.clone()`, or write through the pool).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "kvtui"
POOL_MODULE = PACKAGE / "engine" / "kv_pool.py"
POOL_VIEWS = {"own_keys"}  # kvtui functions that return a view of a pool tensor
COPIES = {"clone", "tolist", "item", "numpy", "new_zeros", "new_ones", "new_full", "new_empty", "masked_fill",
          "index_select", "isfinite", "sum", "mean", "amax", "all", "any"}  # methods whose result is a new tensor
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _own_nodes(scope: ast.AST):
    """The nodes of `scope`, not those inside functions nested in it (each is scanned as its own scope)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(node, SCOPES):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _nested(scope: ast.AST):
    """The functions defined directly in `scope` (not inside another function in it)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(node, SCOPES):
            yield node
        else:
            stack.extend(ast.iter_child_nodes(node))


def _names(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


class PoolWriteScan:
    """The scan of one module's source. `owners`: a name holding one of these words owns pool tensors as
    `.keys` / `.values` ("pool": pool, self.pool, engine.pool; the pool module itself adds "self")."""

    def __init__(self, owners: tuple[str, ...] = ("pool",)) -> None:
        self.owners = owners

    def is_pool_attr(self, node: ast.AST) -> bool:
        """`<x>.keys` or `<x>.values` where x's last name holds an owner word."""
        if not (isinstance(node, ast.Attribute) and node.attr in ("keys", "values")):
            return False
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
        return any(word in name.lower() for word in self.owners)

    def rooted(self, node: ast.AST, tainted: set[str]) -> bool:
        """Whether `node` is (a view of) a pool tensor: a pool attribute, a tainted name, or a subscript,
        attribute or method call chain on one; a call to a POOL_VIEWS function with a pool argument."""
        while True:
            if self.is_pool_attr(node) or (isinstance(node, ast.Name) and node.id in tainted):
                return True
            if isinstance(node, (ast.Subscript, ast.Attribute, ast.Starred)):
                node = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in COPIES:
                    return False
                node = node.func.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in POOL_VIEWS:
                return any(self.rooted(a, tainted) for a in node.args)
            else:
                return False

    def taint(self, scope: ast.AST, tainted: set[str]) -> set[str]:
        """Names in `scope` (a function or module) that may hold a pool tensor, to a fixed point: parameters
        named pool_*, targets of assignments from pool expressions (tuples element by element), loop targets
        over an iterable built from one, `with ... as` targets; and the enclosing scope's (`tainted`)."""
        tainted = set(tainted)
        if isinstance(scope, SCOPES):
            args = scope.args
            tainted |= {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg.startswith("pool_")}
        while True:
            before = len(tainted)
            for node in _own_nodes(scope):
                self._taint_one(node, tainted)
            if len(tainted) == before:
                return tainted

    def _taint_one(self, node: ast.AST, tainted: set[str]) -> None:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                        and len(target.elts) == len(node.value.elts):
                    tainted |= {n for t, v in zip(target.elts, node.value.elts) if self.rooted(v, tainted)
                                for n in _names(t)}
                elif self.rooted(node.value, tainted):
                    tainted |= set(_names(target))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            if any(self.rooted(n, tainted) for n in ast.walk(node.iter)):
                tainted |= set(_names(node.target))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            if self.rooted(node.context_expr, tainted):
                tainted |= set(_names(node.optional_vars))

    def writes(self, scope: ast.AST, tainted: set[str]) -> list[int]:
        """Line numbers in `scope` (not inside nested functions, scanned on their own) that write into a
        pool tensor."""
        lines = []
        for node in _own_nodes(scope):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Subscript) and self.rooted(t.value, tainted):
                        lines.append(t.lineno)
                    elif isinstance(t, ast.Attribute) and t.attr == "data" and self.rooted(t.value, tainted):
                        lines.append(t.lineno)
                    elif isinstance(node, ast.AugAssign) and isinstance(t, ast.Name) and t.id in tainted:
                        lines.append(t.lineno)  # k += x is in place on a tensor
            if isinstance(node, ast.Call) and self._writes_in_call(node, tainted):
                lines.append(node.lineno)
        return lines

    def _writes_in_call(self, node: ast.Call, tainted: set[str]) -> bool:
        """pool_k[...].copy_(x), keys.fill_(0); torch.index_put_(pool_k, ...); f(..., out=pool_k)."""
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        in_place = name.endswith("_") and not name.startswith("_")
        if in_place and isinstance(func, ast.Attribute) and self.rooted(func.value, tainted):
            return True
        if in_place and node.args and self.rooted(node.args[0], tainted):
            return True
        return any(k.arg == "out" and self.rooted(k.value, tainted) for k in node.keywords)

    def __call__(self, source: str) -> list[int]:
        """Line numbers of every write into a pool tensor in `source` (a module's text), sorted."""
        found = []

        def scan(scope: ast.AST, outer: set[str]) -> None:
            tainted = self.taint(scope, outer)
            found.extend(self.writes(scope, tainted))
            for node in _nested(scope):  # a closure sees its enclosing scope's names
                scan(node, tainted)

        scan(ast.parse(source), set())
        return sorted(set(found))


pool_writes = PoolWriteScan()


def test_no_module_but_the_pool_writes_into_the_pool_tensors():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == POOL_MODULE:
            continue
        lines = path.read_text().splitlines()
        for line in pool_writes(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {lines[line - 1].strip()}")
    assert offenders == [], "writes into the KV pool outside kvtui/engine/kv_pool.py (add a pool method):\n" + \
        "\n".join(offenders)


def test_the_pool_module_does_write_and_the_scan_sees_it():
    """The scan is not blind: kv_pool.py itself writes its tensors in its methods, and the scan finds
    each of them (write, allocate's fresh zeros, clear_tails, copy_prefix, copy_block, restore_block)."""
    source = POOL_MODULE.read_text()
    lines = source.splitlines()
    found = {lines[n - 1].strip() for n in PoolWriteScan(("pool", "self"))(source)}  # inside, the pool is self
    assert found >= {
        "self.keys[layer][where, :, positions] = keys.to(self.dtype)",
        "self.keys[layer][slot] = torch.zeros(shape, dtype=self.dtype, device=self.device)",
        "keys[slot, :, start:stop] = 0",
        "keys[dst, :, :length] = keys[src, :, :length]",
        "keys[dst] = keys[src]",
        "keys[block] = data[layer, 0].to(keys.device, keys.dtype)",
    }


FLAGGED = {
    "setitem on a layer tensor": "def f(pool, x):\n    pool.keys[0][1, :, 2] = x",
    "setitem through an alias": "def f(self, x):\n    k = self.pool.keys[self.layer]\n    k[0] = x",
    "a loop over the pool": "def f(pool):\n    for keys, values in zip(pool.keys, pool.values):\n        values[3] = 0",
    "enumerate over the pool": "def f(pool, d):\n    for i, (k, v) in enumerate(zip(pool.keys, pool.values)):\n"
                               "        k[0] = d[i]",
    "an in-place method": "def f(engine):\n    engine.pool.values[2].fill_(float('nan'))",
    "an in-place method on a view": "def f(pool_k, x):\n    pool_k[0, :, 4:].transpose(0, 1).copy_(x)",
    "index_put_ as a function": "def f(pool_v, i, x):\n    torch.index_put_(pool_v, i, x)",
    "out=": "def f(pool, a, b):\n    torch.mul(a, b, out=pool.keys[0][1])",
    ".data": "def f(pool, x):\n    pool.keys[0].data = x",
    "a view from own_keys": "def f(pool_k, seg):\n    k = own_keys(pool_k, seg)\n    k.zero_()",
    "augmented assignment": "def f(pool):\n    k = pool.keys[0]\n    k += 1",
    "a closure": "def f(pool):\n    k = pool.keys[0]\n    def g():\n        k[0] = 1\n    g()",
}
NOT_FLAGGED = {
    "reads": "def f(pool, s):\n    x = pool.keys[0][s, :, :4]\n    return torch.cat([x, x])",
    "a copy": "def f(pool):\n    x = pool.keys[0].clone()\n    x[0] = 1\n    return x",
    "a new tensor": "def f(pool_k):\n    out = pool_k.new_zeros(3)\n    out[0] = 1\n    return out",
    "another cache": "def f(entry):\n    entry.keys[0][0] = 1",
    "a dict's values": "def f(d):\n    for v in d.values():\n        v[0] = 1",
}


def test_the_scan_flags_each_kind_of_write_and_nothing_else():
    for what, source in FLAGGED.items():
        assert pool_writes(textwrap.dedent(source)), what
    for what, source in NOT_FLAGGED.items():
        assert pool_writes(textwrap.dedent(source)) == [], what


def test_clear_tails_zeroes_past_the_owners_length_once_and_again_after_a_write_there():
    """KVPool.clear_tails on a 2-layer pool of 2 slots x 200 positions, NaN everywhere before the owner
    comes: positions end .. k_len - 1 (and TAIL_SLACK more) become 0.0 in every layer's K and V and are
    tagged never written; the owner's positions below `end` keep their values; a second call with nothing
    written past `end` zeroes nothing (a finite marker put there directly survives); a write through
    `write` past `end` (what fp16_cache's pads do) makes the next call zero from `end` again."""
    import torch

    from kvtui.engine.kv_pool import TAIL_SLACK, KVPool

    pool = KVPool(num_layers=2, num_kv_heads=1, head_dim=2, num_slots=2, max_len=200, dtype=torch.float32)
    for t in pool.keys + pool.values:
        t.fill_(float("nan"))
    slot = pool.allocate("a")
    own = torch.arange(10, dtype=torch.long)
    for layer in range(2):
        pool.write(layer, torch.full((10,), slot), own, torch.ones(10, 1, 2), torch.full((10, 1, 2), 2.0))
    pool.clear_tails([(slot, 10)], 30)
    stop = 30 + TAIL_SLACK
    for layer in range(2):
        assert pool.keys[layer][slot, 0, :10].eq(1).all() and pool.values[layer][slot, 0, :10].eq(2).all()
        assert pool.keys[layer][slot, 0, 10:stop].eq(0).all() and pool.values[layer][slot, 0, 10:stop].eq(0).all()
        assert pool.keys[layer][slot, 0, stop:].isnan().all()  # past what was asked for and the slack: untouched
        assert pool.keys[layer][1].isnan().all()  # the other slot: untouched
    assert pool.writer[slot, 10:stop].eq(-1).all()
    pool.keys[0][slot, 0, 20] = 7.0  # a marker, not a pool write
    pool.clear_tails([(slot, 10)], 40)  # within what was zeroed, nothing written past 10 since: no zeroing
    assert pool.keys[0][slot, 0, 20, 0].item() == 7.0
    pool.write(0, torch.tensor([slot]), torch.tensor([25]), torch.full((1, 1, 2), float("inf")),
               torch.full((1, 1, 2), float("inf")))  # past the owner's length, through the pool
    pool.clear_tails([(slot, 10)], 40)
    assert pool.keys[0][slot, 0, 20, 0].item() == 0.0 and pool.keys[0][slot, 0, 25].eq(0).all()
    assert pool.keys[0][slot, 0, :10].eq(1).all()
