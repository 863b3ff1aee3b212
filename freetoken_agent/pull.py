"""`freetoken-agent pull ID [--revision R] [--include GLOB ...]`: download a checkpoint from the
Hugging Face Hub into the Hugging Face cache, where `--model ID` finds it.

Contract: the download is `huggingface_hub.snapshot_download` (its progress bars; `HF_ENDPOINT`,
`HF_TOKEN`, `HF_HOME` / `HF_HUB_CACHE` apply). It resumes: a broken transfer is retried from the
byte it stopped at, and after a failed pull the files already downloaded stay in the cache, so
running it again fetches only what is missing.
`--include` keeps only the files matching the glob(s), e.g. one quantisation of a GGUF repository;
config, tokenizer and chat-template files are always included then, so a directory checkpoint stays
servable. On success it prints the snapshot directory and the command that serves it, exit 0. An
unknown repository or revision, a refused token, an unreachable Hub or a glob that matches nothing
is one line `error: ...`, exit 2 (raised as `UsageError`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from freetoken_agent.models import HF_ID, UsageError

# fetched alongside --include patterns: what `serve` needs besides the weights
SIDE_FILES = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")


def add_pull_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("pull", help="download a checkpoint from the Hugging Face Hub into its local cache",
                       description="Download a model repository with huggingface_hub (resumable) into the "
                                   "Hugging Face cache; `serve --model ID` then finds it offline.")
    p.add_argument("repo_id", metavar="ID", help="the repository, e.g. Qwen/Qwen3-30B-A3B")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    p.add_argument("--include", action="append", default=None, metavar="GLOB",
                   help="download only the files matching GLOB (repeatable), e.g. '*Q4_K_M*.gguf'; the JSON, "
                        "tokenizer and template files come too (default: the whole repository)")


def _matches(name: str, patterns: list[str]) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(name, p) for p in patterns)


def pull(repo_id: str, revision: str | None = None, include: list[str] | None = None) -> Path:
    """Download `repo_id` (or the files matching `include`) into the cache; the snapshot directory."""
    if not HF_ID.match(repo_id):
        raise UsageError(f"{repo_id!r} is not a Hugging Face id (OWNER/NAME)")
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = repo_id + (f" at revision {revision}" if revision else "")
    try:
        if include:
            files = HfApi().list_repo_files(repo_id, revision=revision)
            if not any(_matches(f, include) for f in files):
                raise UsageError(f"{where}: no file matches --include {' '.join(include)} "
                                 f"({len(files)} files, e.g. {', '.join(sorted(files)[:4])})")
        patterns = [*include, *SIDE_FILES] if include else None
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise UsageError(f"{where}: the repository is gated: accept its terms on the Hub and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise UsageError(f"{where}: no such revision") from None
    except RepositoryNotFoundError:
        raise UsageError(f"{repo_id}: no such repository on the Hub (a private one needs HF_TOKEN)") from None
    except OfflineModeIsEnabled:
        raise UsageError(f"{where}: HF_HUB_OFFLINE is set, so nothing can be downloaded") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        text = str(e).strip().splitlines()
        raise UsageError(f"{where}: the download failed ({type(e).__name__}: {text[0] if text else e}); "
                         "run it again to resume") from None


def run_pull(args: argparse.Namespace) -> int:
    path = pull(args.repo_id, args.revision, args.include)
    print(f"{args.repo_id}: {path}")
    if (path / "config.json").is_file():
        model = path if args.revision else args.repo_id  # `--model ID` finds the main revision
        print(f"serve it with: freetoken-agent serve --model {model}", file=sys.stderr)
    else:
        gguf = sorted(path.glob("**/*.gguf"))
        if gguf:
            print(f"GGUF files: {', '.join(str(g) for g in gguf)} (for `freetoken-agent bench --model FILE`)",
                  file=sys.stderr)
    return 0
