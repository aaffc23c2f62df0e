"""The README and the docs cannot drift: each code block runs by itself, quoted lines exist.

Each ```python block is run on its own (``tests/_doc_blocks.py``: its own namespace, so a
block that uses a name it does not define fails), as a reader copies one block. Blocks load
their tokenizer the way a user does, ``AutoTokenizer.from_pretrained(<model name>)``; here,
without network, ``HF_HOME`` holds SmolLM2's tokenizer as ``transformers`` builds it from the
GGUF on disk, and ``HF_HUB_OFFLINE=1``. A block that needs hardware this machine lacks (first
line ``# needs: cuda``, ``tpu`` or ``multi-host``) is compiled, and skipped with the reason.
JAX sees the devices a reader's CPU host has (one: ``XLA_FLAGS`` is not set); the pages whose
blocks set up the devices they need run each block in a fresh process, as a reader runs it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _doc_blocks import blocks

ROOT = Path(__file__).resolve().parents[1]
#: every page a reader opens: the README and docs/**, generated results included
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
BLOCKS = [(doc, line, code) for doc in DOCS for line, code in blocks((ROOT / doc).read_text())]

# JAX warns when a jit donates a buffer it cannot write into (an argmax sampler never
# materialises the masked logits): advice that donates for nothing must not ship.
UNUSABLE_DONATION = "Some donated buffers were not usable"

#: pages whose blocks take long all together (each loads a tokenizer, compiles a grammar)
SLOW_DOCS = {doc for doc in DOCS if doc.startswith("docs/porting/")}
#: pages whose blocks each run in a fresh process (they set up JAX's devices, which must
#: happen before any JAX computation of the process)
FRESH_PROCESS_DOCS = {"docs/porting/jax-sharding.md"}


def _case(doc: str, line: int, code: str) -> object:
    marks = [pytest.mark.slow] if doc in SLOW_DOCS else []
    return pytest.param(doc, line, marks=marks, id=f"{doc}:{line}")


@pytest.fixture(scope="module")
def doc_runs(hf_home, tmp_path_factory):
    """``run(doc)``: each block's record and the process's stderr (one process per page)."""
    done: dict[str, tuple[dict[int, dict], str]] = {}
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HOME=hf_home, HF_HUB_OFFLINE="1")
    env.pop("XLA_FLAGS", None)  # the devices of a reader's CPU host (this suite sets 8)

    def process(doc: str, only: list[str]) -> tuple[list[dict], str]:
        out = tmp_path_factory.mktemp("doc") / "blocks.jsonl"
        proc = subprocess.run(
            [sys.executable, "-W", f"error:{UNUSABLE_DONATION}",
             str(ROOT / "tests" / "_doc_blocks.py"), doc, str(out), *only],
            cwd=ROOT, capture_output=True, text=True, env=env,
            timeout=3600,  # a hang guard only
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in out.read_text().splitlines()], proc.stderr

    def run(doc: str) -> tuple[dict[int, dict], str]:
        if doc not in done:
            if doc in FRESH_PROCESS_DOCS:
                runs = [process(doc, [str(line)]) for line, _ in blocks((ROOT / doc).read_text())]
            else:
                runs = [process(doc, [])]
            records = [record for found, _ in runs for record in found]
            done[doc] = ({r["line"]: r for r in records}, "".join(err for _, err in runs))
        return done[doc]

    return run


@pytest.mark.parametrize(("doc", "line"), [_case(*block) for block in BLOCKS])
def test_code_block_runs_by_itself(doc_runs, doc, line):
    records, _ = doc_runs(doc)
    record = records[line]
    if record["status"] == "compiled":
        pytest.skip(f"{doc}:{line} compiled only: {record['detail']} (not on this machine)")
    assert record["status"] == "passed", f"{doc}:{line}\n{record['detail']}"


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param(doc, marks=[pytest.mark.slow] if doc in SLOW_DOCS else [])
        for doc in sorted({doc for doc, _, _ in BLOCKS})
    ],
)
def test_no_unusable_donation_warning(doc_runs, doc):
    _, stderr = doc_runs(doc)
    assert UNUSABLE_DONATION not in stderr, stderr[-3000:]


def test_blocks_run_one_by_one(tmp_path):
    """The runner gives each block its own namespace: a name defined in one block does not
    exist in the next, and a `# needs: multi-host` block is compiled but not run."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n```python\nprint(x)\n```\n\n"
        "```python\n# needs: multi-host\nraise SystemExit(3)\n```\n\n"
        "```python\n# needs: multi-host\ndef broken(:\n```\n"
    )
    out = tmp_path / "out.jsonl"
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_doc_blocks.py"), str(page), str(out)],
        check=True, timeout=600,
    )  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in records] == ["passed", "failed", "compiled", "failed"]
    assert "NameError: name 'x' is not defined" in records[1]["detail"]
    assert records[2]["detail"] == "needs several hosts"
    assert "SyntaxError" in records[3]["detail"]


def test_pitfall_lines_exist():
    """Every row of the pitfalls table names a file and a line that is in it."""
    section = (ROOT / "docs/porting/pitfalls.md").read_text()
    rows = re.findall(r"^\|[^|]+\| `([^`]+)` \| `(.+)` \|$", section, re.MULTILINE)
    assert len(rows) >= 12
    for path, line in rows:
        content = (ROOT / path).read_text()
        assert line in content, f"{path} no longer contains: {line}"


FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page (code blocks left out):
    lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` ... on repeats."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", text), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        name, n = slug, 0
        while name in found:
            n += 1
            name = f"{slug}-{n}"
        found.add(name)
    return found


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown page (outside code blocks) whose file or anchor is missing."""
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target} (no such heading in {os.path.relpath(dest, path.parent)})")
    return broken


@pytest.mark.parametrize("doc", DOCS)
def test_links_resolve(doc):
    """Every relative link of the README and the docs reaches an existing file and heading."""
    assert not broken_links(ROOT / doc), f"{doc}: {broken_links(ROOT / doc)}"


def test_broken_links_are_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## 4c. Compact masks, `wait=False`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n\n## Top\n\n[a](other.md#4c-compact-masks-waitfalse) [b](#top-1) [c](#top)\n"
        "[d](other.md#4c-compact) [e](gone.md) [f](#nowhere) [g](https://x.org/y.md#z)\n"
        "```\n[h](inside-code.md)\n```\n"
    )
    assert broken_links(page) == [
        "other.md#4c-compact (no such heading in other.md)",
        "gone.md (no such file)",
        "#nowhere (no such heading in page.md)",
    ]


def test_porting_index_lists_every_page():
    """The porting guide's first page names every page of the guide, and every page links
    back to it: a reader who lands anywhere finds the page for their job."""
    folder = ROOT / "docs/porting"
    index = (folder / "README.md").read_text()
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    pages = {p.name for p in folder.glob("*.md")} - {"README.md"}
    assert pages <= listed, f"not in the index: {sorted(pages - listed)}"
    for page in pages:
        assert "](README.md)" in (folder / page).read_text(), f"{page} does not link the index"


#: the largest a page may be, in bytes (generated results in docs/results/ are exempt)
PAGE_LIMIT = {"docs/benchmarks.md": 12 * 1024}


@pytest.mark.parametrize("doc", [d for d in DOCS if d.startswith("docs/")])
def test_page_is_small(doc):
    """A page is read in one sitting: at most 10 KB (benchmarks.md 12 KB)."""
    if doc.startswith("docs/results/"):
        pytest.skip("generated results are exempt")
    size = (ROOT / doc).stat().st_size
    assert size <= PAGE_LIMIT.get(doc, 10 * 1024), f"{doc} is {size} bytes"


def test_the_default_run_is_lean_and_ci_runs_the_rest():
    """`scripts/test.sh` (the README's command) leaves the `slow` tests out; CI runs them."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    options = options["ini_options"]
    assert "-m 'not slow'" in options["addopts"] and "--strict-markers" in options["addopts"]
    assert any(m.startswith("slow:") for m in options["markers"])
    ci = [line.removeprefix("step ") for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert "bash scripts/test.sh" in ci and "bash scripts/test.sh -m slow" in ci
    assert "scripts/test.sh" in (ROOT / "README.md").read_text()


# How the project's own developers reach a GPU is no user's business: phrases of that kind
# must not come back into what users read (docs, scripts, the package's code and comments).
TEAM_PHRASES = re.compile(
    r"\bwork\s+sessions?\b|\bother sessions\b|\banother session\b|\bsession's own\b"
    r"|\blent an? (?:GPU|machine|device)\b|\b(?:device|GPU|\d+-minute) leases?\b"
    r"|\bleases? (?:a |the )?(?:GPU|machine)\b|`?device`?\s+(?:tool|time|calls?)\b"
    r"|\bcarry\s*=|`carry`|\bgive_back\b|\bcan_start\w*|(?-i:\$OUT\b)"
    r"|\bthe lead\b|\bhelper sessions?\b",
    re.IGNORECASE,
)
USER_FACING = [
    "README.md",
    ".ci/run",
    "pyproject.toml",
    *[doc for doc in DOCS if doc.startswith("docs/")],
    *[f"scripts/{p.name}" for p in (ROOT / "scripts").iterdir() if p.is_file()],
    *[str(p.relative_to(ROOT)) for p in (ROOT / "portable_spec").rglob("*.py")],
    *[str(p.relative_to(ROOT)) for p in (ROOT / "backends").rglob("*.py")],
    *[str(p.relative_to(ROOT)) for p in (ROOT / "tools").rglob("*.py")],
    *[str(p.relative_to(ROOT)) for p in (ROOT / "examples").rglob("*.py")],
]


@pytest.mark.parametrize("path", sorted(USER_FACING))
def test_speaks_to_users_only(path):
    text = (ROOT / path).read_text(encoding="utf-8")
    found = [
        f"line {text[: m.start()].count(chr(10)) + 1}: {m.group(0)!r}"
        for m in TEAM_PHRASES.finditer(text)
    ]
    assert not found, f"{path}: {found}"


def test_team_phrases_are_caught():
    for text in [
        "In another session whose task is lent a GPU",
        "the device tool's status",
        "a work\nsession",
        'run(command="...", carry = ["wheels"])',
        "a rerun in a 15-minute lease",
        "then give_back",
        "spending device time",
        "come back from $OUT",
    ]:
        assert TEAM_PHRASES.search(text), text
    for text in ["a DraftSession", "the block is lent", "a lease object", 'cd "$out"']:
        assert not TEAM_PHRASES.search(text), text


def test_benchmarks_count_their_sections():
    """The opening of benchmarks.md says how many sections `scripts/bench.sh` has and
    lists them: the number matches the list."""
    text = (ROOT / "docs/benchmarks.md").read_text()
    numbers = [
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
    ]
    said = re.search(r"in (\w+) sections:\n\n", text)
    assert said, "benchmarks.md no longer says how many sections there are"
    listed = re.findall(r"^(\d+)\. \*\*", text[said.end() :].split("\n\n", 1)[0], re.MULTILINE)
    assert numbers.index(said.group(1)) + 1 == len(listed) == int(listed[-1])


# -- the offline line: what a reader without a model hub runs instead of from_pretrained -------
OFFLINE = "# no model hub here? "
OFFLINE_CODE = "from portable_spec.testing import hf_tokenizer; tokenizer = hf_tokenizer()"
FROM_PRETRAINED = re.compile(r"^tokenizer = AutoTokenizer\.from_pretrained\(.*$", re.MULTILINE)


def test_every_offline_line_is_the_same_code():
    """Every example's offline comment is the one line the README blocks run below."""
    for doc in DOCS:
        for number, text in enumerate((ROOT / doc).read_text().splitlines(), 1):
            if OFFLINE in text:
                assert text.strip() == OFFLINE + OFFLINE_CODE, f"{doc}:{number}: {text}"


def test_readme_blocks_run_offline_as_written(tmp_path):
    """Each README block with the offline comment runs with that comment's code in place of
    its ``from_pretrained`` line, as a reader without a model hub runs it: an empty Hugging
    Face cache, ``HF_HUB_OFFLINE=1`` (where ``from_pretrained`` itself would fail)."""
    pytest.importorskip("transformers")
    variants = []
    for _, code in blocks((ROOT / "README.md").read_text()):
        if OFFLINE in code:
            assert len(FROM_PRETRAINED.findall(code)) == 1, code
            variants.append(FROM_PRETRAINED.sub(OFFLINE_CODE, code))
    assert len(variants) >= 3
    page = tmp_path / "offline.md"
    page.write_text("".join(f"```python\n{code}```\n\n" for code in variants))
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
               HF_HOME=str(tmp_path / "empty-hf-home"))  # fmt: skip
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_doc_blocks.py"), str(page), str(out)],
        cwd=ROOT, env=env, check=True, timeout=3600,
    )  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in records] == ["passed"] * len(variants), records
