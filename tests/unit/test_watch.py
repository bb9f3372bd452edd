"""`gossamer watch`'s table: progress, totals, a row per role with its step rate and straggler flag."""

from __future__ import annotations

from rich.console import Console

from gossamer.tools.watch import WatchView, detached_note, outcome_line, stragglers


def _status(**kw: object) -> dict[str, object]:
    st: dict[str, object] = {
        "id": "digits-1a2b3c", "name": "digits", "state": "running", "steps": 600, "total_steps": 1500,
        "generation": 2, "message": "", "checkpoint": "", "started_unix": 1000.0, "finished_unix": 0.0,
        "metrics": {"loss": 0.31, "eval_accuracy": 0.9361, "eval_loss": 0.25, "samples_per_s": 812.0,
                    "bytes_up": 12.5e6, "bytes_down": 3.2e6, "compression_ratio": 3.9},
        "roles": [
            {"node_id": "aaa", "node": "spot-0", "role": "worker", "index": 0, "replica": 0, "endpoint": ""},
            {"node_id": "bbb", "node": "spot-1", "role": "worker", "index": 1, "replica": 0, "endpoint": "",
             "straggler": True},
            {"node_id": "ccc", "node": "od-0", "role": "ps", "index": 0, "replica": 0, "endpoint": "tcp://x"},
            {"node_id": "ddd", "node": "od-1", "role": "ps", "index": 0, "replica": 1, "endpoint": "tcp://y"},
        ],
    }
    st.update(kw)
    return st


def _text(renderable: object) -> str:
    console = Console(record=True, width=140, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_table_shows_progress_totals_and_one_row_per_role_with_rates() -> None:
    view = WatchView()
    points = [{"time_unix": 1000.0 + t, "step": 10 * t, "source": "aaa/0", "updates": 10.0 * t} for t in range(5)]
    points += [{"time_unix": 1000.0 + t, "step": 10 * t, "source": "bbb/0", "updates": 2.0 * t} for t in range(5)]
    points += [{"time_unix": 1000.0 + t, "step": 12 * t, "source": "ccc/ps0", "ps_updates": 12.0 * t,
                "staleness_mean": 1.5, "staleness_max": 4.0} for t in range(5)]
    view.update(_status(), points, [{"id": "aaa", "name": "spot-0", "lease_age_s": 0.4}])
    text = _text(view.render())
    assert "digits" in text and "running" in text and "600/1500" in text and "40%" in text
    assert "0.9361" in text and "812" in text and "12.5 MB" in text and "3.9x" in text
    assert "staleness mean 1.50, max 4 versions" in text
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in text.splitlines() if line.startswith("│")]
    rows = {c[0]: c for c in cells}
    assert rows["spot-0"] == ["spot-0", "worker 0", "40", "10.0", "0.4s ago", ""]
    assert rows["spot-1"] == ["spot-1", "worker 1", "8", "2.0", "-", "straggler"]
    assert rows["od-0"] == ["od-0", "ps 0", "48", "12.0", "-", ""]
    assert rows["od-1"][1] == "ps 0 (backup)"


def test_summary_of_a_finished_experiment() -> None:
    view = WatchView()
    view.update(_status(state="completed", message="completed 1500 steps", finished_unix=1090.0,
                        checkpoint="/ckpt/final", metrics={"steps": 1500.0, "eval_accuracy": 0.97, "bytes_up": 2e6}))
    text = _text(view.summary())
    assert "completed 1500 steps" in text and "0.9700" in text and "/ckpt/final" in text and "1:30" in text


def test_stragglers_are_read_from_any_place_the_status_carries_them() -> None:
    assert stragglers({"stragglers": ["n1", {"node_id": "x2"}], "roles": []}) == {"n1", "x2"}
    assert stragglers(_status()) == {"spot-1", "bbb"}
    assert stragglers({"roles": []}, [{"id": "i", "name": "m", "straggler": True}]) == {"i", "m"}
    assert stragglers({"roles": []}) == set()


def test_what_watch_says_on_detaching_depends_on_the_state() -> None:
    why = "waiting for 5 nodes (2 for shards, on-demand preferred; 3 for workers); 3 free (1 on-demand, 2 spot)"
    assert detached_note(_status(state="queued", message=why)) == f"it stays queued ({why})"
    assert detached_note(_status(state="starting")) == "it keeps starting (its shards are coming up)"
    assert detached_note(_status(state="running")) == "it keeps running"


def test_a_cancelled_or_failed_run_reports_the_steps_it_reached() -> None:
    st = _status(state="cancelled", message="cancelled by user", steps=640)
    assert outcome_line(st) == "cancelled: cancelled by user (step 640/1500)"
    done = _status(state="completed", message="completed 1500 steps, eval accuracy 0.9700", steps=1500)
    assert outcome_line(done) == "completed: completed 1500 steps, eval accuracy 0.9700"  # said once
    view = WatchView()
    view.update(st)
    assert "640/1500" in _text(view.summary())
