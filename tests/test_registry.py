"""The registry of records: one record per name with tags derived from the class, tag queries (what benchmarks use
instead of hand lists), a deprecation path for renamed encodings, and an import graph without circles."""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

import vispe
from vispe.encodings import (
    CONTRACTS,
    AttentionBiasEncoding,
    EncodingContext,
    TokenEncoding,
    benchmark_encodings,
    create_encoding,
    encoding_records,
    get_encoding_class,
    get_record,
    list_encodings,
    register_alias,
    register_encoding,
)
from vispe.encodings import base as registry
from vispe.encodings.composed import attention_side

ENCODINGS_DIR = Path(vispe.encodings.__file__).parent


@pytest.fixture
def scratch_registry(monkeypatch):
    """Names registered inside a test leave the registry afterwards."""
    monkeypatch.setattr(registry, "_RECORDS", dict(registry._RECORDS))


@pytest.mark.parametrize("record", encoding_records(), ids=lambda r: r.name)
def test_record_tags_are_derived_from_the_class(record):
    cls = record.cls
    assert record.name == cls.registry_name and record.grid_ndim == cls.grid_ndims
    assert record.kind in CONTRACTS and record.mechanism == cls.kind
    if record.kind == "bias":
        assert issubclass(cls, AttentionBiasEncoding)
    if record.kind == "rotary":  # q/k rotation: the attention side acts (a composition: its rotary part)
        assert attention_side(cls) or cls.is_composition
    if record.kind == "token":
        assert not attention_side(cls)
    assert set(record.benchmark) <= set(record.grid_ndim) and record.family and record.deprecated is None
    assert record.paper is None or record.paper.count(".") == 1


def test_list_encodings_filters_by_contract_finer_kind_grid_and_tags():
    assert set(list_encodings(kind="bias")) == {r.name for r in encoding_records() if issubclass(r.cls, AttentionBiasEncoding)}
    assert list_encodings(kind="conditional") == ["cpe"]  # a class's finer kind still filters
    assert "cpe" in list_encodings(kind="token") and "none" in list_encodings(kind="token")
    assert all(3 in get_encoding_class(n).grid_ndims for n in list_encodings(grid_ndim=3))
    assert list_encodings(family="comrope") == ["comrope_ap", "comrope_ld", "comrope_ld_3d"]
    with pytest.raises(TypeError, match=r"unknown encoding tag\(s\) \['colour'\]; valid tags: \["):
        encoding_records(colour="red")


def test_benchmark_defaults_cover_the_published_sets_and_every_new_encoding():
    # the speed tables (docs/speed.md) were measured on these sets; the registry's benchmark tags keep selecting them,
    # and an encoding registered with no benchmark tag joins every benchmark of its grids with no list edited
    published_2d = {"none", "learned", "sincos2d", "rope_axial", "rope_mixed", "comrope_ap", "comrope_ld", "irpe", "cpe",
                    "lff", "loope", "rope_dinov3", "alibi_2d", "fire", "liere[block_size=8]"}
    published_3d = {"learned_3d", "none", "sincos3d", "rope_axial_3d", "rope_mixed_3d", "comrope_ld_3d", "rope_dinov3_3d",
                    "alibi_3d", "fire_3d", "liere_3d[block_size=8]"}
    for ndim, published in ((2, published_2d), (3, published_3d)):
        chosen = set(benchmark_encodings(ndim))
        assert published <= chosen
        tagged = {r.name for r in encoding_records() if ndim in r.benchmark}
        assert {spec.split("[")[0] for spec in chosen} == tagged
    assert {"pope", "golden_rope", "nd_rope"} <= set(benchmark_encodings(2)) & set(benchmark_encodings(3))
    assert set(list_encodings(groups="scaling")) == {"none", "learned", "rope_mixed", "comrope_ld", "irpe", "seqpe"}
    assert benchmark_encodings(2, kind="bias") == ["alibi_2d", "fire", "irpe"]


def test_a_new_encoding_needs_no_list(scratch_registry):
    @register_encoding("scratch_table")
    class ScratchTable(TokenEncoding):
        """A test encoding (arXiv 2010.11929)."""

        grid_ndims = (2,)

        def __init__(self, dim: int, grid_size=(4, 4), scale: float = 1.0) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(1, grid_size[0] * grid_size[1], dim))

        def embed_tokens(self, x, grid, state=None, image=None):
            return self.add_to_tokens(x, self.table, grid)

    record = get_record("scratch_table")
    assert (record.kind, record.grid_ndim, record.family, record.paper) == ("token", (2,), __name__, "2010.11929")
    assert "scratch_table" in list_encodings(grid_ndim=2) and "scratch_table" in benchmark_encodings(2)
    assert "scratch_table" not in benchmark_encodings(3)
    enc = create_encoding("scratch_table", EncodingContext(dim=8, num_heads=2, depth=1, grid_size=(4, 4)))
    assert enc.table.shape == (1, 16, 8)
    with pytest.raises(ValueError, match="scratch_table.*scale="):  # the annotation's rule, once, at construction
        create_encoding("scratch_table", dim=8, scale=float("nan"))
    with pytest.raises(ValueError, match="already registered to ScratchTable"):
        register_encoding("scratch_table")(type("Other", (TokenEncoding,), {}))
    with pytest.raises(ValueError, match=r"kind='colour' is not a contract; choose one of \['token', 'bias', 'rotary'\]"):
        register_encoding("scratch_bad", kind="colour")(ScratchTable)


def test_renamed_encoding_still_builds_with_a_future_warning(scratch_registry):
    register_alias("rope_axial_old", "rope_axial")
    ctx = EncodingContext(dim=32, num_heads=2, depth=1, grid_size=(3, 3))
    with pytest.warns(FutureWarning, match="'rope_axial_old' is deprecated: it was renamed 'rope_axial'"):
        enc = create_encoding("rope_axial_old", ctx)
    assert type(enc) is get_encoding_class("rope_axial") and enc.registry_name == "rope_axial"
    assert "rope_axial_old" not in list_encodings() and "rope_axial_old" not in benchmark_encodings(2)
    assert [r.name for r in encoding_records(include_deprecated=True, deprecated="rope_axial")] == ["rope_axial_old"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name builds without a warning
        create_encoding("rope_axial", ctx)

    # a class kept under its old name by the decorator itself
    @register_encoding("learned_old", deprecated="learned")
    class LearnedOld(get_encoding_class("learned")):
        pass

    with pytest.warns(FutureWarning, match="renamed 'learned'"):
        create_encoding("learned_old", ctx)


def _imports(path: Path, package: str) -> set[str]:
    """Sibling modules of ``vispe.encodings`` that ``path`` imports at run time, at module level or inside functions."""
    found = set()
    parts = path.relative_to(ENCODINGS_DIR).with_suffix("").parts
    here = [package, *parts[:-1]]
    tree = ast.parse(path.read_text())
    # imports under `if TYPE_CHECKING:` are for type checkers only: never executed, they cannot form a circle
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith(package + ".") and n != package)
    return found


def test_encoding_modules_import_without_a_circle():
    package = "vispe.encodings"
    modules = {}
    for path in sorted(ENCODINGS_DIR.rglob("*.py")):
        rel = path.relative_to(ENCODINGS_DIR).with_suffix("").parts
        if rel[-1] == "__init__":  # a package's __init__ imports its modules to register them
            continue
        modules[".".join((package, *rel))] = path
    graph = {m: {i for i in _imports(p, package) if i in modules and i != m} for m, p in modules.items()}
    assert graph[f"{package}.composed"] == {f"{package}.base", f"{package}.grid"}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, f"import circle: {' -> '.join(stack + [m, n])}"
            if n not in state:
                visit(n, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_multimodal_schemes_are_fields_of_their_records():
    from vispe.positions import SCHEMES

    with_scheme = encoding_records(kind="rotary")
    assert {r.name for r in with_scheme if r.scheme is not None} == set(SCHEMES)
    for name, scheme in SCHEMES.items():
        record = get_record(name)
        assert record.scheme is scheme and scheme.name == name and not record.benchmark  # LLM-side: opt-in
        enc = create_encoding(name, EncodingContext(dim=64, num_heads=2, depth=1, grid_size=(2, 3)))
        assert enc.num_coords == record.scheme.num_coords


def test_every_decorated_name_in_the_package_is_registered_by_discovery():
    """No hand list of modules: each name a module of the package decorates is registered by ``import vispe``."""
    decorated = set()
    for path in ENCODINGS_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for dec in node.decorator_list:
                    if (isinstance(dec, ast.Call) and getattr(dec.func, "id", None) in ("register_encoding", "register_preset")
                            and dec.args and isinstance(dec.args[0], ast.Constant)):
                        decorated.add(dec.args[0].value)
    assert len(decorated) > 30 and decorated <= set(list_encodings())
    init = (ENCODINGS_DIR / "__init__.py").read_text()
    assert "import_encoding_modules()" in init and "from . import" not in init


def test_benchmark_commands_take_their_defaults_from_the_registry():
    from vispe.benchmarks.scaling import main as scaling_main
    from vispe.benchmarks.speed import BENCH_CONFIGS
    from vispe.benchmarks.speed_report import growth_biases

    assert BENCH_CONFIGS["vit_s16"].default_encodings == tuple(benchmark_encodings(2))
    assert BENCH_CONFIGS["video_s16"].default_encodings == tuple(benchmark_encodings(3))
    assert growth_biases() == benchmark_encodings(2, kind="bias")
    # the default encodings resolve (registry group 'scaling') before the strategies are checked
    with pytest.raises(ValueError, match="unknown strategy 'bogus'"):
        scaling_main(["--strategies", "bogus"])
