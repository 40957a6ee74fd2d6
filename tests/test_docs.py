"""The docs cannot go stale silently.

docs/ARCHITECTURE.md: every repository path it puts in backticks must exist, every
`Class.member` it names must still be defined, every snake_case name must still occur in
the code, every file of a request's path must be named, its request path (the `callchain`
blocks) must be what the code calls, and the diagram it embeds must be there beside its
source.  docs/FLAGS.md documents every flag of `pagestream serve` and every environment
variable of scheduler/envs.py; README.md stays a front page that links the references;
docs/PERFORMANCE.md stays the current state.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"

# The files a request passes through, WebSocket or SSE frame in to frame out.
REQUEST_PATH = [
    "service/app.py",
    "service/state.py",
    "service/ws.py",
    "service/protocol.py",
    "service/protocol_ws.py",
    "service/protocol_openai.py",
    "service/http_util.py",
    "service/openai_api.py",
    "service/openai_chat.py",
    "service/openai_common.py",
    "service/tokenizer.py",
    "service/async_engine.py",
    "service/outputs.py",
    "service/detokenizer.py",
    "scheduler/engine_core.py",
    "scheduler/scheduler.py",
    "scheduler/kv_cache_manager.py",
    "scheduler/block_pool.py",
    "scheduler/contract.py",
    "scheduler/executor.py",
    "scheduler/stream.py",
    "scheduler/prefix_tier.py",
    "gpu/model_runner.py",
    "gpu/cuda_graphs.py",
    "gpu/model.py",
    "gpu/attention/base.py",
    "gpu/attention/torch_backend.py",
    "gpu/attention/triton_backend.py",
    "gpu/cpu/kernels/__init__.py",
    "gpu/cpu/kernels/paged_decode.h",
    "gpu/cpu/kernels/paged_prefill.cpp",
    "gpu/kernels/kv_cache.py",
    "gpu/kernels/attention.py",
    "gpu/sampler.py",
]

# A relative path inside a code span: `dir/`, `dir/file.py`, or one inside a command.
_PATH = re.compile(r"(?<![\w/.:-])((?:[A-Za-z_][\w.-]*/)+[\w.-]*)")
# `Name.member`: a class (or module) and something defined on it.
_MEMBER = re.compile(r"^([A-Za-z_]\w*)\.([A-Za-z_]\w*)$")
# A name with an underscore in it, or a private one: surely an identifier, not a word.
_SNAKE = re.compile(r"[a-z_][a-z0-9_]*_[a-z0-9_]*|_\w+")
_FILE_EXTENSIONS = {"py", "md", "json", "png", "dot", "cpp", "h", "txt", "yml", "toml"}
_PACKAGES = ("service", "scheduler", "gpu", "modelkit", "bench", "tests")


def _spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def doc_paths(text: str) -> set[str]:
    return {m for span in _spans(text) for m in _PATH.findall(span)}


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for pkg in _PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _defines(src: str, member: str) -> bool:
    m = re.escape(member)
    return bool(
        re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{m}\b", src, re.M)
        or re.search(rf"^\s*(?:self\.)?{m}\s*[:=]", src, re.M)
    )


def unknown_names(text: str, sources: dict[Path, str]) -> list[str]:
    """Bare snake_case names (`_sample_rows`, `hash_block`) that no source file mentions:
    a function, field or library call the code no longer has."""
    names = {s for s in _spans(text) if _SNAKE.fullmatch(s)}
    corpus = "\n".join(sources.values())
    return sorted(n for n in names if not re.search(rf"\b{re.escape(n)}\b", corpus))


def undefined_members(text: str, sources: dict[Path, str]) -> list[str]:
    bad = []
    for span in dict.fromkeys(_spans(text)):
        m = _MEMBER.match(span)
        if m is None:
            continue
        owner, member = m.groups()
        if member in _FILE_EXTENSIONS:
            continue  # a file name (`config.json`)
        is_class = owner[0].isupper() and not owner.isupper()
        # Files that define `owner` as a class, or that are the module / package `owner`.
        homes = [
            src
            for path, src in sources.items()
            if re.search(rf"^class\s+{re.escape(owner)}\b", src, re.M)
            or (not is_class and path.stem == owner)
            or (not is_class and path.name == "__init__.py" and path.parent.name == owner)
        ]
        if not homes:
            if is_class:
                bad.append(f"{span}: nothing named {owner!r} is defined")
            continue  # a variable or a third-party module (`meta.slot_mapping`, `asyncio.x`)
        submodule = any(
            (p.parent / f"{member}.py").is_file()
            for p, src in sources.items()
            if src in homes and p.name == "__init__.py"
        )
        if not submodule and not any(_defines(src, member) for src in homes):
            bad.append(f"{span}: {owner} defines no {member!r}")
    return bad


def test_every_path_in_the_architecture_doc_exists() -> None:
    text = DOC.read_text()
    paths = doc_paths(text)
    assert len(paths) > 30, "the path pattern stopped matching the doc"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_class_member_in_the_architecture_doc_is_defined() -> None:
    bad = undefined_members(DOC.read_text(), _sources())
    assert not bad, "docs/ARCHITECTURE.md names things that are not defined:\n" + "\n".join(bad)


def test_every_function_name_in_the_architecture_doc_is_in_the_code() -> None:
    unknown = unknown_names(DOC.read_text(), _sources())
    assert not unknown, f"docs/ARCHITECTURE.md names what the code no longer has: {unknown}"


def test_the_doc_names_every_file_of_the_request_path() -> None:
    paths = doc_paths(DOC.read_text())
    for p in REQUEST_PATH:
        assert (ROOT / p).is_file(), f"{p} is gone: update REQUEST_PATH and the doc"
    unnamed = [p for p in REQUEST_PATH if p not in paths]
    assert not unnamed, f"docs/ARCHITECTURE.md does not name {unnamed}"


def test_the_diagram_is_embedded_and_committed_with_its_source() -> None:
    text = DOC.read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    assert "architecture.png" in images
    png = DOC.parent / "architecture.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "digraph" in (DOC.parent / "architecture.dot").read_text()


def test_readme_links_the_architecture_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "(docs/ARCHITECTURE.md)" in readme
    assert "../shared/" not in readme, "README links outside the repository"


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("`scheduler/` and `gpu/model.py`", {"scheduler/", "gpu/model.py"}),
        ("`dot -Tpng docs/a.dot -o docs/a.png`", {"docs/a.dot", "docs/a.png"}),
        ("`GET /v1/ws` and `?api_key=` and `a.b`", set()),
    ],
)
def test_the_path_finder(text: str, expect: set[str]) -> None:
    assert doc_paths(text) == expect


def test_the_member_checker_sees_a_rename() -> None:
    srcs = {ROOT / "x" / "m.py": "class Foo:\n    def bar(self):\n        self.baz = 1\n"}
    assert undefined_members("`Foo.bar` `Foo.baz`", srcs) == []
    assert undefined_members("`Foo.qux`", srcs) == ["Foo.qux: Foo defines no 'qux'"]
    assert undefined_members("`Nope.bar`", srcs) == ["Nope.bar: nothing named 'Nope' is defined"]
    assert unknown_names("`_gone_fn` `do_it` `word`", srcs) == ["_gone_fn", "do_it"]
    # Modules are checked too; variables, file names and other libraries are not.
    assert undefined_members("`m.bar` `m.nope` `meta.x` `m.json`", srcs) == [
        "m.nope: m defines no 'nope'"
    ]


# ----------------------------------------------------------------- the request path's calls
# docs/ARCHITECTURE.md lists the request path as chains of functions in ```callchain
# blocks: one `path qualname [via NAME]` a line, a blank line between chains.  Each
# function must call (or hand on as a callback) the next one: by the next one's own name,
# or, with `via NAME`, by calling NAME (an nn.Module or object called through __call__).
# The files whose functions every request runs through: each must appear in a chain.
CHAIN_FILES = {
    "service/app.py",
    "service/ws.py",
    "service/prep.py",
    "service/tokenize_pool.py",
    "service/openai_chat.py",
    "service/openai_common.py",
    "service/async_engine.py",
    "service/detokenizer.py",
    "scheduler/engine_core.py",
    "scheduler/scheduler.py",
    "scheduler/kv_cache_manager.py",
    "scheduler/executor.py",
    "scheduler/stream.py",
    "gpu/model_runner.py",
    "gpu/model.py",
    "gpu/attention/torch_backend.py",
    "gpu/sampler.py",
}
_CHAIN_BLOCK = re.compile(r"```callchain\n(.*?)```", re.S)


def doc_chains(text: str) -> list[list[tuple[str, str, str | None]]]:
    chains = []
    for block in _CHAIN_BLOCK.findall(text):
        for part in re.split(r"\n\s*\n", block.strip()):
            chain = []
            for line in part.strip().splitlines():
                words = line.split()
                via = words[3] if len(words) == 4 and words[2] == "via" else None
                if len(words) not in (2, 4) or (len(words) == 4 and via is None):
                    raise ValueError(f"not `path qualname [via NAME]`: {line!r}")
                chain.append((words[0], words[1], via))
            chains.append(chain)
    return chains


def find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    body: list[ast.stmt] = tree.body
    *owners, name = qualname.split(".")
    for owner in owners:
        cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if cls is None:
            return None
        body = cls.body
    return next(
        (
            n
            for n in body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
        ),
        None,
    )


def _called_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def reaches(fn: ast.AST, target: str, via: str | None) -> bool:
    """`fn` calls `via(...)` (given), else names `target` (a call, or a callback handed on)."""
    for node in ast.walk(fn):
        if via is not None:
            if isinstance(node, ast.Call) and _called_name(node.func) == via:
                return True
        elif isinstance(node, ast.Name | ast.Attribute) and _called_name(node) == target:
            return True
    return False


def chain_problems(chains: list[list[tuple[str, str, str | None]]], root: Path) -> list[str]:
    trees: dict[str, ast.Module] = {}
    bad = []
    for chain in chains:
        fns = []
        for path, qualname, _ in chain:
            file = root / path
            if not file.is_file():
                bad.append(f"{path}: no such file")
                fns.append(None)
                continue
            tree = trees.setdefault(path, ast.parse(file.read_text(), path))
            fn = find_function(tree, qualname)
            if fn is None:
                bad.append(f"{path} defines no {qualname}")
            fns.append(fn)
        for (a, (pa, qa, _)), (pb, qb, via) in zip(zip(fns, chain), chain[1:], strict=False):
            if a is None:
                continue
            if not reaches(a, qb.split(".")[-1], via):
                how = f"calls no {via}(...)" if via else f"never names {qb.split('.')[-1]}"
                bad.append(f"{pa} {qa} {how}: the chain's next step is {pb} {qb}")
    return bad


def test_the_request_path_follows_the_real_calls() -> None:
    chains = doc_chains(DOC.read_text())
    assert sum(len(c) for c in chains) > 30, "the callchain blocks went missing"
    bad = chain_problems(chains, ROOT)
    assert not bad, "docs/ARCHITECTURE.md's request path is not what the code calls:\n" + (
        "\n".join(bad)
    )
    named = {path for chain in chains for path, _, _ in chain}
    missing = sorted(CHAIN_FILES - named)
    assert not missing, f"files of the request path in no callchain: {missing}"


def test_the_chain_checker_sees_a_rename_and_a_reroute(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "def a():\n    b()\n\n"
        "def b():\n    obj.model(1)\n\n"
        "class C:\n    def forward(self):\n        self.later = self.d\n\n"
        "    def d(self):\n        pass\n"
    )
    good = [[("m.py", "a", None), ("m.py", "b", None), ("m.py", "C.forward", "model")]]
    good.append([("m.py", "C.forward", None), ("m.py", "C.d", None)])  # a callback counts
    assert chain_problems(good, tmp_path) == []
    renamed = [[("m.py", "a", None), ("m.py", "bb", None)]]
    assert chain_problems(renamed, tmp_path) == [
        "m.py defines no bb",
        "m.py a never names bb: the chain's next step is m.py bb",
    ]
    rerouted = [[("m.py", "b", None), ("m.py", "a", None)]]
    assert chain_problems(rerouted, tmp_path) == [
        "m.py b never names a: the chain's next step is m.py a"
    ]
    wrong_via = [[("m.py", "a", "model"), ("m.py", "b", "model")]]
    assert chain_problems(wrong_via, tmp_path) == [
        "m.py a calls no model(...): the chain's next step is m.py b"
    ]
    text = "```callchain\nm.py a\nm.py b\n\nm.py b\nm.py C.forward via model\n```\n"
    assert doc_chains(text) == [
        [("m.py", "a", None), ("m.py", "b", None)],
        [("m.py", "b", None), ("m.py", "C.forward", "model")],
    ]


# ----------------------------------------------------------------- docs/FLAGS.md
def serve_flags() -> list[str]:
    """Every long option of `pagestream serve`, from the parser itself."""
    from service.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    return [
        opt
        for action in serve._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    ]


def test_every_serve_flag_is_documented() -> None:
    flags = serve_flags()
    assert len(flags) > 60, "the flag finder stopped seeing the parser"
    text = (ROOT / "docs" / "FLAGS.md").read_text()
    documented = set(re.findall(r"`(--[a-z0-9-]+)", text))
    missing = [f for f in flags if f not in documented]
    assert not missing, f"docs/FLAGS.md does not document {missing}"
    unknown = sorted(documented - set(flags) - {"--help"})
    assert not unknown, f"docs/FLAGS.md documents flags serve does not have: {unknown}"


def test_every_environment_variable_is_in_the_flags_doc() -> None:
    from scheduler import envs

    text = (ROOT / "docs" / "FLAGS.md").read_text()
    missing = [name for name in (*envs.VARS, *envs.SETS) if f"`{name}`" not in text]
    assert not missing, f"docs/FLAGS.md does not document {missing}"


def test_the_readme_stays_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in ("API", "FLAGS", "LIMITS", "METRICS", "PERFORMANCE", "ARCHITECTURE"):
        assert f"(docs/{page}.md" in readme, f"README does not link docs/{page}.md"
        assert (ROOT / "docs" / f"{page}.md").is_file()
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", readme)
    assert images and all((ROOT / i).is_file() for i in images), images


def test_the_performance_doc_is_the_current_state() -> None:
    perf = ROOT / "docs" / "PERFORMANCE.md"
    text = perf.read_text()
    assert len(text.splitlines()) <= 600
    # A journal per sitting goes to git and bench/results/: no times of day in the doc.
    assert not re.findall(r"\b\d\d:\d\d\b", text), "a per-minute timestamp in PERFORMANCE.md"
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    assert images and all((perf.parent / i).is_file() for i in images), images
