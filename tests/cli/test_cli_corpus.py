"""The bad command lines users actually make: each is refused with exactly one line on stderr (its exact words
below: the option named, what was expected), its exit code, no traceback, before any work (nothing written)."""

from __future__ import annotations

import json
import shlex

import pytest

from eagle31_mla.cli import main
from tests.support.engine_configs import draft, write_config

TARGET = "--target {r}/model --draft {r}/model --prompts {r}/prompts.txt"  # a valid offline acceptance pair
TRAIN = "train --target {r}/model --text {r}/prompts.txt"
SERVER = "acceptance --server http://127.0.0.1:9 --engine vllm --prompts {r}/prompts.txt"
CAPTURE = "capture --target {r}/model --text {r}/prompts.txt"
PAIR = "--prefill-command 'vllm serve T' --decode-command 'vllm serve T'"  # a PD pair for doctor


def spec_pair(spec: str) -> str:
    """doctor on a PD pair whose prefill side passes this --speculative-config."""
    prefill = shlex.quote(f"vllm serve T --speculative-config {shlex.quote(spec)}")
    return f"doctor --engine vllm --prefill-command {prefill} --decode-command 'vllm serve T'"


#: (command line, exit code, the message after "eagle31-mla: error: "); "{r}" is the fixture folder
BAD = [
    # a path that is not there, or not of its kind
    (f"acceptance {TARGET} --prompts {{r}}/missing.txt", 2,
     "argument --prompts: File '{r}/missing.txt' does not exist."),
    (f"{TRAIN} --out {{r}}/out --text {{r}}/a-folder", 2, "argument --text: File '{r}/a-folder' is a directory."),
    (f"{TRAIN} --out {{r}}/a-file.txt", 2, "argument --out: Directory '{r}/a-file.txt' is a file."),
    (f"acceptance {TARGET} --json {{r}}/no-such/r.json", 2,
     "argument --json: expected a file path in an existing, writable folder, got '{r}/no-such/r.json'"),
    ("acceptance --prompts '' --target {r}/model --draft {r}/model", 2, "argument --prompts: expected a path, got ''"),
    # a model reference that is neither a model folder nor a Hub repo id
    ("inspect {r}/nowhere", 2, "argument PATH_OR_ID: expected a model folder, its config.json, or a Hub repo id like "
     "org/name, got '{r}/nowhere': no such folder or file"),
    ("inspect {r}/a-folder", 2, "argument PATH_OR_ID: expected a model folder, its config.json, or a Hub repo id like "
     "org/name, got '{r}/a-folder': the folder has no config.json"),
    ("acceptance --target {r}/prompts.txt --draft {r}/model --prompts {r}/prompts.txt", 2, "argument --target: expected"
     " a model folder (with config.json) or a Hub repo id like org/name, got '{r}/prompts.txt': a file, not a folder"),
    # numbers out of their range, or not numbers
    ("demo --prompts -1", 2, "argument --prompts: -1 is not in the range x>=1."),
    ("demo --max-new-tokens -3", 2, "argument --max-new-tokens: -3 is not in the range 1<=x<=10000000."),
    ("demo --prompts 9999", 2, "argument --prompts: expected at most 24 (the held-out prompts shipped), got 9999"),
    ("serve-command --engine vllm --num-steps 100", 2, "argument --num-steps: 100 is not in the range 1<=x<=64."),
    ("serve-command --engine vllm --tp 1000000000000000000000", 2, "--tp 1000000000000000000000: the drafter's 64 "
     "attention heads do not split evenly over that many ranks, as every engine shards them; use a divisor of 64"),
    # a launch line is untrusted: its speculative settings typed as the engine types them
    (spec_pair('{"model": "D", "num_speculative_tokens": NaN}'), 2, "argument --prefill-command: "
     "--speculative-config's num_speculative_tokens must be an integer in [1, 4096], got nan"),
    (spec_pair('{"model": "D", "num_speculative_tokens": 1e40}'), 2, "argument --prefill-command: "
     "--speculative-config's num_speculative_tokens must be an integer in [1, 4096], got 1e+40"),
    (spec_pair('{"model": ["D"], "num_speculative_tokens": 3}'), 2, "argument --prefill-command: "
     "--speculative-config's model must be a path or hub id, got ['D']"),
    ("doctor --engine sglang --prefill-command 'sglang serve --model-path T --speculative-num-steps 1e9' "
     "--decode-command 'sglang serve --model-path T'", 2, "argument --prefill-command: argument "
     "--speculative-num-steps: invalid count value: '1e9'"),
    ("serve-command --engine vllm --tp x", 2, "argument --tp: 'x' is not a valid integer range."),
    (f"acceptance {TARGET} --top-p 1.5", 2, "argument --top-p: 1.5 is not in the range 0<x<=1."),
    (f"{TRAIN} --out {{r}}/out --lr nan", 2, "argument --lr: 'nan' is not a finite number."),
    ("demo --engine tf", 2, "argument --engine: 'tf' is not one of 'hf', 'vllm'."),
    # the domain's own values
    ("convert {r}/model {r}/dst --max-shard-size 10MiB", 2, "argument --max-shard-size: expected a size like 10GB or "
     "500MB (powers of ten) or a number of bytes, > 0, got '10MiB': cannot read a size from '10MiB' (e.g. 10GB, 500MB, "
     "1000000)"),
    (f"{TRAIN} --out {{r}}/out --aux-layers 46,2", 2, "argument --aux-layers: expected comma-separated one-based layer "
     "ids, ascending, each >= 1 (e.g. 2,46,90), got '46,2'"),
    ("doctor --env 1X=2", 2, "argument --env: expected NAME=VALUE with NAME an environment variable name, got '1X=2'"),
    ("doctor --engine-version v1", 2, "argument --engine-version: expected a release like 0.30 or 0.22.1, got 'v1'"),
    (f"acceptance {TARGET} --device gpu", 2,
     "argument --device: expected auto, cpu, cuda, cuda:N, mps or xpu:N, got 'gpu'"),
    (f"{CAPTURE} --out {{r}}/out --engine-args [1]", 2, "argument --engine-args: expected a JSON object of vLLM engine "
     "arguments, e.g. '{\"tensor_parallel_size\": 8}', got '[1]': not a JSON object"),
    ("acceptance --server ftp://x --engine vllm --prompts {r}/prompts.txt", 2, "argument --server: expected an http:// "
     "or https:// URL of a running server, like http://127.0.0.1:8000, got 'ftp://x'"),
    (f"{SERVER} --reference {{r}}/a-file.txt", 2, "argument --reference: expected an `eagle31-mla acceptance --json` "
     "report, got '{r}/a-file.txt': not JSON (Expecting value: line 1 column 1 (char 0))"),
    # options that go together, or exclude each other
    ("convert {r}/model {r}/dst --prune-vocab 10", 2, "--prune-vocab N and --token-counts FILE go together"),
    (f"{SERVER} --expect 2 --reference {{r}}/offline.json", 2,
     "argument --reference: not allowed with argument --expect"),
    ("capture --target {r}/model --out {r}/out", 2,
     "one of the arguments --text --prompts --conversations is required"),
    (f"{TRAIN} --out {{r}}/out --init {{r}}/model --draft-config {{r}}/model", 2,
     "argument --draft-config: not allowed with argument --init"),
    (f"acceptance {TARGET} --server http://127.0.0.1:9", 2, "--target is for the offline measurement (the pair "
     "loaded here); --server measures what the server runs: drop --target"),
    (f"acceptance {TARGET} --expect 2.5", 2,
     "--expect measures a running server: it needs --server URL (or drop --expect)"),
    (f"acceptance {TARGET} --topk 4", 2, "tree drafting (topk 4) needs num_draft_tokens (root included), at most 37"),
    (f"acceptance {TARGET} --topk 1 --num-draft-tokens 9", 2,
     "chain drafting verifies num_steps + 1 = 4 tokens, got num_draft_tokens 9"),
    (f"acceptance {TARGET} --revision v9", 2, "argument --revision: expected a --target given as a Hub repo id (a "
     "revision names a Hub branch, tag or commit), got 'v9' with the local folder {r}/model; drop --revision"),
    ("acceptance --target {r}/model --draft {r}/model --prompts {r}/blank.txt", 2,
     "argument --prompts: expected at least one prompt, {r}/blank.txt has none"),
    (f"{TRAIN} --out {{r}}/out --seq-len 4 --depth 4", 2, "argument --seq-len: expected more than --depth 4 tokens "
     "(each unroll step needs a next token to predict), got 4"),
    (f"{TRAIN} --out {{r}}/out --aux-layers 1,2,9", 2,
     "argument --aux-layers: expected one-based ids <= 4 (the target's depth), got 1,2,9"),
    ("train --target {r}/model --text {r}/blank.txt --out {r}/out", 2,
     "argument --text: expected at least one non-empty document, {r}/blank.txt has none"),
    ("serve-command --engine tokenspeed --topk 2 --num-draft-tokens 4", 2,
     "TokenSpeed's --speculative-eagle-topk accepts only 1"),
    ("serve-command --engine vllm --topk 2 --num-draft-tokens 6", 2,
     "vLLM's EAGLE-3 drafts a chain: use --topk 1 (num_speculative_tokens = --num-steps)"),
    ("serve-command --engine sglang --num-draft-tokens 7", 2,
     "with topk 1 the draft is a chain: --num-draft-tokens must be --num-steps + 1 = 4"),
    ("serve-command --engine sglang --topk 2 --num-steps 3 --num-draft-tokens 1000", 2, "--num-draft-tokens is 1000; "
     "a tree of topk 2 over 3 steps holds 2 to 11 tokens (root included)"),
    ("serve-command --engine vllm --connector nixl", 2, "argument --connector: applies to --pd only"),
    ("serve-command --engine vllm --pd --connector ascend", 2,
     "--connector ascend is not one of vLLM's: nixl, mooncake, lmcache, example"),
    ("serve-command --engine sglang --pd --connector example", 2,
     "--connector example is not one of SGLang's: mooncake, nixl, ascend, mori"),
    ("serve-command --engine vllm --pd --connector example", 2, "--connector example: vLLM's Kimi-K3 is a hybrid "
     "model (KDA + MLA layers) and ExampleConnector cannot move a hybrid cache (no hybrid KV-cache manager): the "
     "server would not start; use nixl or mooncake"),
    ("serve-command --engine tokenspeed --pd --topk 2 --num-draft-tokens 4", 2,
     "TokenSpeed's --speculative-eagle-topk accepts only 1"),
    ("doctor --draft {r}/draft --engine vllm", 2, "doctor needs --target"),
    ("doctor --target {r}/model --draft {r}/a-file.txt --engine vllm", 2, "{r}/a-file.txt: not a readable JSON file "
     "(Expecting value: line 1 column 1 (char 0)); expected a config.json object"),
    ("doctor --target {r}/model --draft {r}/draft --engine vllm --eagle3-layers-to-capture 2,46,90", 2,
     "--eagle3-layers-to-capture is TokenSpeed's flag (use --engine tokenspeed)"),
    ("doctor --draft {r}/model --target {r}/draft --engine vllm", 2, "--draft {r}/model and --target {r}/draft look "
     "swapped: the target's config.json is an EAGLE drafter's and the draft's is not; expected --draft DRAFTER "
     "--target TARGET"),
    ("doctor --engine vllm --prefill-command 'vllm serve T'", 2, "a PD pair needs --decode-command"),
    (f"doctor {PAIR}", 2, "a PD pair needs --engine"),
    (f"doctor --engine vllm --draft {{r}}/draft {PAIR}", 2,
     "argument --draft: a PD pair takes it from --prefill-command and --decode-command"),
    (f"doctor --engine sglang {PAIR}", 2, "argument --prefill-command: expected SGLang's launch command (sglang serve "
     "or -m sglang.launch_server ...), got 'vllm serve T'"),
    # an output that would overwrite an input: the same file (a hard link too), or around or inside it
    (f"acceptance {TARGET} --json {{r}}/prompts.txt", 2, "argument --json: expected a path apart from the inputs: "
     "'{r}/prompts.txt' is the same file as --prompts '{r}/prompts.txt', which it would overwrite"),
    (f"acceptance {TARGET} --json {{r}}/hard-link.txt", 2, "argument --json: expected a path apart from the inputs: "
     "'{r}/hard-link.txt' is the same file as --prompts '{r}/prompts.txt', which it would overwrite"),
    ("convert {r}/model {r}/a-folder/../model/sub", 2, "argument DST: expected a path apart from the inputs: "
     "'{r}/a-folder/../model/sub' is inside SRC '{r}/model', which it would overwrite"),
    ("convert {r}/model {r}/model", 2, "argument DST: expected a path apart from the inputs: '{r}/model' is the same "
     "file as SRC '{r}/model', which it would overwrite"),
    ("convert {r}/model {r}/model/../.", 2, "argument DST: expected a path apart from the inputs: '{r}/model/../.' "
     "contains SRC '{r}/model', which it would overwrite"),
    ("convert {r}/model {r}/loop --force", 2, "DST {r}/loop: cannot follow its links (a symlink loop)"),
    (f"{TRAIN} --out {{r}}", 2, "argument --out: expected a path apart from the inputs: '{r}' contains --target "
     "'{r}/model', which it would overwrite"),
    # the command line itself
    ("nope", 2, "argument command: invalid choice: 'nope' (choose from 'demo', 'roster', 'acceptance', 'train', "
     "'capture', 'inspect', 'convert', 'doctor', 'serve-command')"),
    ("serve-command", 2, "the following arguments are required: --engine"),
    ("serve-command --engine vllm --nmu-steps 3", 2, "unrecognized arguments: --nmu-steps (did you mean --num-steps?)"),
]  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "model").mkdir()
    config = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 300}
    (root / "model" / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    write_config(root / "draft", draft())  # an EAGLE drafter's config, for doctor
    (root / "prompts.txt").write_text("Once upon a time\n")
    (root / "hard-link.txt").hardlink_to(root / "prompts.txt")
    (root / "blank.txt").write_text("\n   \n\n")
    (root / "a-file.txt").write_text("x")
    (root / "a-folder").mkdir()
    (root / "loop").symlink_to(root / "loop")
    (root / "offline.json").write_text(json.dumps({"settings": {}, "total": {"mean_accept_length": 2.5}}))
    return root


def files(root) -> dict:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("line, code, message", BAD, ids=[line.replace("{r}/", "") for line, _, _ in BAD])
def test_a_bad_command_line_is_one_exact_line(line, code, message, root, capsys):
    before = files(root)
    assert main(shlex.split(line.replace("{r}", str(root)))) == code
    captured = capsys.readouterr()
    assert captured.err == f"eagle31-mla: error: {message.replace('{r}', str(root))}\n" and not captured.out
    assert files(root) == before and not (root / "out").exists() and not (root / "dst").exists()


def test_a_name_the_file_system_refuses_is_one_line(capsys):
    assert main(["inspect", "/tmp/" + "n" * 300]) == 2  # os.stat: ENAMETOOLONG, not "no such file"
    err = capsys.readouterr().err
    assert err.startswith("eagle31-mla: error: argument PATH_OR_ID: expected") and err.count("\n") == 1
    assert err.endswith("...' (305 characters): File name too long\n"), err


def test_an_unexpected_failure_is_one_line_unless_asked(monkeypatch, capsys):
    boom = RuntimeError("boom\nsecond line")
    monkeypatch.setattr("eagle31_mla.serving.command.serve_command", lambda *a, **k: (_ for _ in ()).throw(boom))
    assert main(["serve-command", "--engine", "vllm"]) == 1
    err = "unexpected RuntimeError: boom; second line (set EAGLE31_MLA_TRACEBACK=1 for the traceback)"
    assert capsys.readouterr().err == f"eagle31-mla: error: {err}\n"
    monkeypatch.setenv("EAGLE31_MLA_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        main(["serve-command", "--engine", "vllm"])
