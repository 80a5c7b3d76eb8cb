"""Mutation testing of the update rules: would the tests notice a wrong coefficient?

    python -m venv /tmp/mutation-venv
    /tmp/mutation-venv/bin/pip install mutmut jax optax flax chex numpy pytest hypothesis scipy scikit-learn dp-accounting
    /tmp/mutation-venv/bin/python tools/mutation.py fedprox scaffold feddyn --out benchmarks/results/mutation.json
    /tmp/mutation-venv/bin/python tools/mutation.py admm_sharing --functions _logistic_z_update   # one function

For each named module of `fedjax_opt/algorithms/` (one module of a package by
its dotted name, `matched_averaging.matching`; all of them by the package's
name, `matched_averaging`, or `asynchrony` for `fedjax_opt/core/asynchrony/`; outside it `robust`,
`attacks`, `compression`, and `dp`, `secure`, `accounting` for `fedjax_opt/privacy/`),
mutmut (3.x) changes one thing at a time in its update rules (an operator, a
constant, an argument; lines of argument checks, error messages, defaults and
metric names are left alone, `NOT_UPDATE_RULES`) and runs the tests that reach the mutated function, chosen from the module's own
test file plus the shared checks (tests/test_rounds.py, test_every_algorithm.py,
test_convention.py, test_bits_metrics.py). A mutant is killed when a test fails, survives when all
pass; a timeout is a mutant whose tests ran much longer than the clean run
(JAX recompiles every mutant, so the allowance is generous).

mutmut runs, for each mutant, the tests it saw call the mutated function.
A test that uses an object built at import time (a module-level
`qsgd(bits=4)`, a cached compiled step) calls the factory in no test, so
mutmut never runs it for that factory's mutants. Every survivor is therefore
run again against all of its module's own test files (`MUTANT_UNDER_TEST`, the
way mutmut itself switches a mutant on; `--jobs` at a time, one per core by default): a failure there
kills it ("rechecked" in the table), and the first failing test is named in the JSON (`killed_by_recheck`). So
are the mutants mutmut found no test for, and the "timeouts" that are test sessions that crashed (exit 255, e.g. a
mutant that breaks an import); a mutant stopped for its CPU time (its tests ran far longer) is not. Each outcome is
stored in the work copy (`recheck.json`) as it comes, so a stopped recheck goes on where it was (delete the file
after changing the tests). `--no-recheck` runs no new recheck.
`--collect WORKDIR` writes the table of a run that was stopped (from the
results mutmut stored in its work copy so far) without running anything
but the recheck. The script
prints a table (per module: mutants, killed, timeouts, survived) and writes it
with the surviving mutants' names to `--out` as JSON; `mutmut show <name>`
(run in the work copy the script prints) shows a survivor's diff.

It runs on a copy of the repository, in an environment where `fedjax_opt`
itself is NOT installed (the venv above has only its dependencies): an
installed or editable `fedjax_opt` would be imported instead of mutmut's
mutated copy, and every mutant would look untested.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import difflib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOT_UPDATE_RULES = [r"\braise\b", r"\bcheck_\w+\(", r"_check\w*\(", r"warnings\.warn", r"[\"']",
                    r"^\s*(if|elif) .*(is None|isinstance|is_concrete)", r"\.resolve\("]
"""Lines that are not update rules (argument checks, messages, defaults, metric names): left unmutated."""
SHARED_TESTS = ["tests/test_rounds.py", "tests/test_every_algorithm.py", "tests/test_convention.py",
                "tests/test_bits_metrics.py"]
COMPRESSION_TESTS = ["tests/test_compression.py", "tests/test_compression_composition.py"]
TESTS_OF = {
    # Compression (a client stage chained before the aggregator) on FedAvg, FedSGD, FedProx, FedNova and SCAFFOLD
    # is tested in its own files.
    "fedavg": ["tests/test_fedavg.py", *COMPRESSION_TESTS], "fedprox": ["tests/test_fedprox.py", *COMPRESSION_TESTS],
    "fednova": ["tests/test_fednova.py", *COMPRESSION_TESTS], "scaffold": ["tests/test_scaffold.py", *COMPRESSION_TESTS],
    "feddyn": ["tests/test_feddyn.py"], "ditto": ["tests/test_ditto.py"],
    "pfedme": ["tests/test_pfedme.py"], "easgd": ["tests/test_easgd.py"], "fedu": ["tests/test_fedu.py"],
    "per_fedavg": ["tests/test_per_fedavg.py"], "fedavg_finetune": ["tests/test_fedavg_finetune.py"],
    "mixture": ["tests/test_mixture.py"], "admm_consensus": ["tests/test_admm.py"],
    "admm_sharing": ["tests/test_admm.py"], "gadmm": ["tests/test_gadmm.py"],
    "mixture_admm": ["tests/test_mixture_admm.py"],
    "ifca": ["tests/test_ifca.py"], "clustered_fl": ["tests/test_clustered_fl.py"], "fedem": ["tests/test_fedem.py"],
    "fedmd": ["tests/test_fedmd.py"],
    **{f"matched_averaging.{m}": ["tests/test_matched_averaging.py"]
       for m in ("neurons", "matching", "layerwise", "one_shot", "fedma_rounds", "models")},
    "matched_averaging.host_loop": ["tests/test_train_host.py"],
    "decentralized": ["tests/test_decentralized.py"], "p2p_bayes": ["tests/test_p2p_bayes.py"],
    "asynchronous": ["tests/test_asynchronous.py", "tests/test_asynchrony.py"],
    # Outside fedjax_opt/algorithms/: the robust aggregators, the attacks, the asynchronous simulation.
    "robust": ["tests/test_robust_aggregators.py"],
    "dp": ["tests/test_privacy.py", "tests/test_compression_composition.py"],
    "secure": ["tests/test_secure_aggregation.py", "tests/test_compression_composition.py"],
    "accounting": ["tests/test_accounting.py"],
    "compression": [*COMPRESSION_TESTS, "tests/test_compression_families.py", "tests/test_downlink.py"],
    # Poisoned deferred data (a client loop gathers one client's poisoned rows) is tested with the deferred rounds.
    "attacks": ["tests/test_attacks.py", "tests/test_robust_aggregators.py", "tests/test_deferred.py"],
    **{f"asynchrony.{m}": ["tests/test_asynchrony.py", "tests/test_asynchronous.py", "tests/test_cli_network.py"]
       for m in ("history", "distributions", "schedules", "staleness", "events", "synchronous")},
}
PATH_OF = {"robust": "fedjax_opt/aggregators/robust.py", "attacks": "fedjax_opt/attacks.py",
           "dp": "fedjax_opt/privacy/dp.py", "secure": "fedjax_opt/privacy/secure.py",
           "accounting": "fedjax_opt/privacy/accounting.py",
           "compression": "fedjax_opt/compression.py",
           **{m: f"fedjax_opt/core/{m.replace('.', '/')}.py" for m in TESTS_OF if m.startswith("asynchrony.")}}
"""Module files not under fedjax_opt/algorithms/ (the others are fedjax_opt/algorithms/<name>.py, a dotted name
<package>.<module> the file fedjax_opt/algorithms/<package>/<module>.py)."""
PACKAGES = {package: [m for m in TESTS_OF if m.startswith(package + ".")]
            for package in ("matched_averaging", "asynchrony")}
"""A package's name on the command line stands for all of its modules."""


def _path(module: str) -> str:
  return PATH_OF.get(module, f"fedjax_opt/algorithms/{module.replace('.', '/')}.py")


def _modules(names: list[str]) -> list[str]:
  """The module keys of command-line names: a package's name expands to its modules, in order, once each."""
  return list(dict.fromkeys(m for name in names for m in PACKAGES.get(name, [name])))


def _module_of(mutant: str) -> str:
  """The module key of a mutant's name, e.g. fedjax_opt.aggregators.robust.x_krum__mutmut_3 -> robust."""
  for module in TESTS_OF:
    if mutant.startswith(_path(module)[:-3].replace("/", ".") + "."):
      return module
  return mutant


def _changes(mutated: pathlib.Path, module: str) -> dict[str, str]:
  """Every mutant of one module in mutmut's mutated copy `mutated`: its name -> its function and changed lines.

  The change (the original line(s) and the mutated one(s)) identifies a mutant across edits elsewhere in the
  file, which renumber mutmut's names; `--only` matches survivors by it.
  """
  text = mutated.read_text()
  # Functions are `x_<name>`, methods (indented in their class) `xǁ<Class>ǁ<method>`.
  heads = list(re.finditer(r"^( *)def (x[_ǁ]\w+?)__mutmut_(orig|\d+)\(", text, re.M))
  bodies = {}
  for head, end in zip(heads, [h.start() for h in heads[1:]] + [len(text)]):
    lines = text[head.start():end].splitlines()
    indent = len(head.group(1))
    body = [lines[0][head.end() - head.start():]]
    for line in lines[1:]:
      if line.strip() and len(line) - len(line.lstrip()) <= indent and not line.lstrip().startswith(")"):
        break  # the first statement after the function, at its level or above
      body.append(line)
    while len(body) > 1 and not body[-1].strip():  # the blank lines before the next function
      body.pop()
    bodies[head.group(2), head.group(3)] = body
  prefix = _path(module)[:-3].replace("/", ".")
  return {f"{prefix}.{func}__mutmut_{tag}": func + "\n" + "\n".join(
              line for line in difflib.ndiff(bodies[func, "orig"], body) if line[:2] in ("- ", "+ "))
          for (func, tag), body in bodies.items() if tag != "orig"}


def _select(changes: dict[str, str], functions: list[str] | None, wanted: set[str] | None) -> list[str]:
  """The mutants (names, from `_changes`) of the named functions (all if None) whose change is in `wanted` (all
  if None)."""
  return [n for n, change in changes.items()
          if (functions is None or _function_of(change) in functions) and (wanted is None or change in wanted)]


def _function_of(change: str) -> str:
  """The mutated function's name in the module (mutmut's `x_<name>` without its prefix) of a `_changes` value."""
  return change.split("\n", 1)[0][2:]


def _generated_changes(work: pathlib.Path, module: str, env: dict) -> dict[str, str]:
  """`_changes` of one module's mutants in the work copy, generated by mutmut without running any test."""
  out = work / "mutants-preview" / _path(module)
  code = ("import pathlib, sys\nfrom mutmut.__main__ import create_mutants_for_file\n"
          "create_mutants_for_file(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))")
  out.parent.mkdir(parents=True, exist_ok=True)
  (work / "mutants" / _path(module)).parent.mkdir(parents=True, exist_ok=True)  # mutmut writes its .meta there
  try:
    subprocess.run([sys.executable, "-c", code, _path(module), str(out.relative_to(work))], cwd=work, env=env,
                   check=True, stderr=subprocess.DEVNULL)
    return _changes(out, module)
  finally:  # leave `mutmut run` a clean work copy
    shutil.rmtree(work / "mutants-preview", ignore_errors=True)
    shutil.rmtree(work / "mutants", ignore_errors=True)


def _test_files(module: str) -> list[str]:
  """The test files of `module` itself (not the shared checks, which mutmut's selection reaches) that exist."""
  return sorted(t for t in TESTS_OF[module] if (ROOT / t).exists())


def _recheck(work: pathlib.Path, name: str, env: dict, timeout: float) -> tuple[str, str | None]:
  """A survivor run against all of its module's test files: ("killed", the first test that failed or could not be
  collected), ("survived", None) (all pass), or ("timeout", None)."""
  mutant_env = dict(env, MUTANT_UNDER_TEST=name)
  try:
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", "-p",
                           "no:randomly", *_test_files(_module_of(name))], cwd=work / "mutants", env=mutant_env,
                          capture_output=True, text=True, timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return "timeout", None
  if done.returncode in (0, 5):
    return "survived", None
  failed = re.search(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
  return "killed", failed.group(1) if failed else f"pytest exit {done.returncode}"


def _stored_codes(work: pathlib.Path, modules: list[str]) -> dict[str, int | None]:
  """The exit code mutmut stored for every mutant of `modules` in `work` (its `.meta` files), by name; None for
  those a stopped run had not reached."""
  codes = {}
  for module in modules:
    meta = work / "mutants" / (_path(module) + ".meta")
    if meta.exists():
      codes.update(json.loads(meta.read_text()).get("exit_code_by_key", {}))
  return codes


def _stored_results(work: pathlib.Path, modules: list[str]) -> dict[str, str]:
  """The status of every mutant of `modules` in `work` (from mutmut's `.meta` files), by name: "not run" for those
  a stopped run had not reached."""
  return {name: "not run" if code is None else _status_of_exit_code(code)
          for name, code in _stored_codes(work, modules).items()}


def _status_of_exit_code(code: int) -> str:
  """mutmut's name for a mutant's stored exit code (mutmut.stats.status_by_exit_code, where it exists)."""
  try:
    from mutmut.stats import status_by_exit_code  # pylint: disable=import-outside-toplevel
    return status_by_exit_code[code]
  except ImportError:
    return {0: "survived", 1: "killed", 3: "killed", 5: "no tests", 33: "no tests", 36: "timeout", 24: "timeout",
            -24: "timeout", 152: "timeout", 255: "timeout"}.get(code, "suspicious")


def _config(modules: list[str], timeout: float) -> str:
  targets = {_path(m) for m in modules}
  skip = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "fedjax_opt").rglob("*.py")
                if str(p.relative_to(ROOT)) not in targets)
  tests = sorted(t for t in {t for m in modules for t in TESTS_OF[m]} | set(SHARED_TESTS) if (ROOT / t).exists())
  lines = ["", "[tool.mutmut]", 'source_paths = ["fedjax_opt/"]', f"do_not_mutate = {json.dumps(skip)}",
           f"do_not_mutate_patterns = {json.dumps(NOT_UPDATE_RULES)}",
           f"tests_dir = {json.dumps(tests)}", 'also_copy = ["tests/"]',
           # mutmut 3.8 stops a mutant after 2 · multiplier · (its tests' clean time + constant) CPU seconds; the
           # constant covers the compiles a mutant cannot take from the cache (its mutated function's programs).
           f"timeout_constant = {timeout}", "timeout_multiplier = 2.5",
           # JAX starts threads once it computes: a worker forked from a process that ran the tests can deadlock.
           'process_isolation = "forkserver"', 'forkserver_warmup = "none"']
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("modules", nargs="+", choices=sorted(TESTS_OF) + sorted(PACKAGES),
                      help="modules of fedjax_opt/algorithms/ (matched_averaging: all of its package's modules, "
                           "matched_averaging.<module>: one), robust (aggregators/robust.py), attacks, compression, "
                           "dp, secure, accounting (privacy/dp.py, secure.py, accounting.py), or asynchrony "
                           "(core/asynchrony/, or asynchrony.<module>)")
  parser.add_argument("--out", default=None, help="JSON file for the table and the survivors")
  parser.add_argument("--timeout", type=float, default=30.0,
                      help="seconds added to a mutant's clean test time before mutmut's multiplier (its allowance "
                           "is 5 × (clean time + this) CPU seconds)")
  parser.add_argument("--workdir", default=None, help="where to copy the repository (default: a new temp dir)")
  parser.add_argument("--verbose", action="store_true", help="show mutmut's own progress output")
  parser.add_argument("--only", default=None,
                      help="a JSON file written by --out: re-test only its survivors (after adding tests), matched "
                           "by their change, so edits elsewhere in the module do not matter")
  parser.add_argument("--functions", nargs="+", default=None, metavar="NAME",
                      help="mutate only these functions of the modules (e.g. _logistic_z_update after rewriting it)")
  parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                      help="rechecks run at a time (default: one per core, as mutmut runs its workers)")
  parser.add_argument("--no-recheck", action="store_true",
                      help="do not run the survivors again against all of their module's test files")
  parser.add_argument("--collect", default=None, metavar="WORKDIR",
                      help="the work copy of an earlier (e.g. stopped) run: tabulate what it ran, recheck its "
                           "survivors, run no new mutant")
  args = parser.parse_args(argv)
  args.modules = _modules(args.modules)
  try:
    import fedjax_opt  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    print("fedjax_opt is installed in this environment: mutmut's mutated copy would not be the one tested. "
          "Use a virtualenv with only its dependencies (see the module docstring).", file=sys.stderr)
    return 2
  except ImportError:
    pass
  if shutil.which("mutmut") is None and not (pathlib.Path(sys.executable).parent / "mutmut").exists():
    print("mutmut is not installed in this environment (pip install mutmut).", file=sys.stderr)
    return 2
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if args.collect:
    work = pathlib.Path(args.collect)
    statuses = _stored_results(work, args.modules)
    if not statuses:
      print(f"--collect: no mutant of {', '.join(args.modules)} has run in {work}.", file=sys.stderr)
      return 2
    return _report(work, statuses, args, env)
  work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="fedjax_opt-mutation-"))
  if work.exists():
    shutil.rmtree(work)
  shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", ".venv", "mutants", "__pycache__", "runs"))
  pyproject = work / "pyproject.toml"
  pyproject.write_text(pyproject.read_text().split("\n[tool.mutmut]")[0] + _config(args.modules, args.timeout))
  mutmut = str(pathlib.Path(sys.executable).parent / "mutmut")
  print(f"mutating {', '.join(args.modules)} in {work} ...", flush=True)
  names = []
  if args.functions or args.only:
    wanted = None
    if args.only:  # the earlier survivors, found again by their change (names shift when the file is edited)
      earlier = json.loads(pathlib.Path(args.only).read_text())
      wanted = set()
      for module, group in earlier["survivors"].items():
        changes = earlier.get("changes", {}).get(module)
        if changes is None:  # written before changes were stored: read them from that run's work copy
          changes = _changes(pathlib.Path(earlier["workdir"]) / "mutants" / _path(module), module)
        # Changes stored before trailing blank lines were dropped end in a blank "- " line.
        wanted |= {re.sub(r"(\n[-+] ?)+$", "", changes[n]) for n in group}
    generated = {n: c for module in args.modules for n, c in _generated_changes(work, module, env).items()}
    mutated_functions = {_function_of(c) for c in generated.values()}
    unknown = sorted(set(args.functions or ()) - mutated_functions)
    if unknown:
      print(f"--functions: no mutant in {', '.join(unknown)} (functions with mutants in {', '.join(args.modules)}: "
            f"{', '.join(sorted(mutated_functions))}).", file=sys.stderr)
      return 2
    names = _select(generated, args.functions, wanted)
    if not names:
      print("none of the earlier survivors is left in these modules (each was changed or removed).")
      return 0
  subprocess.run([mutmut, "run", *names], cwd=work, env=env, check=False,
                 stdout=None if args.verbose else subprocess.DEVNULL)
  listing = subprocess.run([mutmut, "results", "--all", "true"], cwd=work, env=env, capture_output=True, text=True)
  only = set(names)
  statuses = {}
  for line in listing.stdout.splitlines():
    if ":" not in line:
      continue
    name, status = (s.strip() for s in line.rsplit(":", 1))
    if not only or name in only:
      statuses[name] = status
  return _report(work, statuses, args, env)


def _report(work: pathlib.Path, statuses: dict[str, str], args: argparse.Namespace, env: dict) -> int:
  """Recheck the survivors (unless --no-recheck), print the table and write --out."""
  rechecked = collections.Counter()
  killed_by = {}
  # mutmut also files a crash of the test session (exit 255, e.g. a mutant that breaks an import) as a timeout:
  # those are run again; a mutant stopped for its CPU time (SIGXCPU) made the tests run far longer, and is not.
  # "no tests": mutmut's selection reached no test of the function, the module's test files may.
  codes = _stored_codes(work, list(dict.fromkeys(_module_of(n) for n in statuses)))
  pending = [n for n, status in statuses.items()
             if status in ("survived", "no tests") or (status == "timeout" and codes.get(n, 255) == 255)]
  # Each outcome is stored in the work copy as it comes, so a stopped recheck goes on where it was (delete the file
  # after changing the tests).
  stored_path = work / "recheck.json"
  stored = json.loads(stored_path.read_text()) if stored_path.exists() else {}
  todo = [] if args.no_recheck else [n for n in pending if n not in stored]
  # Each recheck is one pytest process, mostly one core's XLA compiles: `--jobs` of them at a time.
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, getattr(args, "jobs", 1))) as pool:
    futures = {pool.submit(_recheck, work, name, env, 10 * 60 + args.timeout): name for name in todo}
    for i, future in enumerate(concurrent.futures.as_completed(futures)):
      name, (status, test) = futures[future], future.result()
      print(f"recheck {i + 1}/{len(todo)} {name.rsplit('.', 1)[-1]}: {status}{f' by {test}' if test else ''}",
            flush=True)
      stored[name] = [status, test]
      stored_path.write_text(json.dumps(stored, indent=1))
  unchecked = collections.Counter()
  for name in pending:
    if name not in stored:
      unchecked[_module_of(name)] += 1
      continue
    status, test = stored[name]
    if test:
      killed_by[name] = test
    if status != statuses[name]:
      statuses[name] = status
      rechecked[_module_of(name)] += 1
  counts = collections.defaultdict(collections.Counter)
  survivors = collections.defaultdict(list)
  for name, status in statuses.items():
    module = _module_of(name)
    counts[module][status] += 1
    if status == "survived":
      survivors[module].append(name)
  table = {m: {"mutants": sum(c.values()), "killed": c["killed"], "timeout": c["timeout"],
               "survived": c["survived"],
               "other": sum(c.values()) - c["killed"] - c["timeout"] - c["survived"] - c["not run"],
               "rechecked": rechecked[m], **({"not_run": c["not run"]} if c["not run"] else {}),
               **({"not_rechecked": unchecked[m]} if unchecked[m] else {})}
           for m, c in sorted(counts.items())}
  print(f"{'module':<16} {'mutants':>8} {'killed':>7} {'timeout':>8} {'survived':>9} {'other':>6} {'rechecked':>10} "
        f"{'not run':>8}")
  for m, row in table.items():
    print(f"{m:<16} {row['mutants']:>8} {row['killed']:>7} {row['timeout']:>8} {row['survived']:>9} {row['other']:>6} "
          f"{row['rechecked']:>10} {row.get('not_run', 0):>8}")
  if args.out:
    changes = {}
    for module, group in survivors.items():
      everything = _changes(work / "mutants" / _path(module), module)
      changes[module] = {n: everything[n] for n in group}
    pathlib.Path(args.out).write_text(json.dumps(
        {"table": table, "survivors": survivors, "changes": changes, "workdir": str(work),
         **({"killed_by_recheck": killed_by} if killed_by else {})}, indent=2))
  print(f"survivors: `mutmut show <name>` in {work}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
