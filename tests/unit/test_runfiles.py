"""fedrun.runfiles: no write of fedrun's goes through a link in a run dir, whenever the link was made."""

import os
import stat

import pytest

from fedrun.runfiles import LinkedFile, appended, linked, replaced, write_text


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "elsewhere" / "yours.txt"
    path.parent.mkdir()
    path.write_text("keep me\n")
    return path


@pytest.mark.parametrize("kind", ["symbolic", "hard"])
def test_a_whole_file_replaces_a_link_at_its_name_and_never_writes_through_it(tmp_path, victim, kind):
    run = tmp_path / "run"
    run.mkdir()
    target = run / "summary.csv"
    target.symlink_to(victim) if kind == "symbolic" else target.hardlink_to(victim)
    write_text(target, "value\n1\n")
    assert victim.read_text() == "keep me\n"
    assert target.read_text() == "value\n1\n" and not target.is_symlink() and target.stat().st_nlink == 1
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in run.iterdir()) == ["summary.csv"]  # no temporary file left


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), replaced(path, "wb") as handle:
        handle.write(b"half")
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_temporary_names_are_new_and_unpredictable(tmp_path, monkeypatch):
    """The old checkpoint's temporary name held the pid (readable in fedrun.lock): a link made at it in advance was
    written through. mkstemp's names are random and created exclusively, so a link at any name is never opened."""
    names = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: names.append(os.path.basename(a)) or real(a, b))
    for _ in range(2):
        write_text(tmp_path / "run.json", "{}\n")
    assert len(set(names)) == 2 and all(str(os.getpid()) not in n for n in names)


def test_an_appended_file_is_created_appended_to_and_refused_once_it_is_a_link(tmp_path, victim):
    path = tmp_path / "metrics.csv"
    with appended(path, newline="") as handle:
        handle.write("round\n")
    with appended(path, newline="") as handle:
        handle.write("1\n")
    assert path.read_text() == "round\n1\n"
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(LinkedFile, match=r"metrics.csv is a symbolic link: fedrun does not write through it"):
        appended(path)
    path.unlink()
    path.hardlink_to(victim)
    with pytest.raises(LinkedFile, match=r"metrics.csv is a hard link"):
        appended(path)
    dangling = tmp_path / "alpha.csv"
    dangling.symlink_to(tmp_path / "nowhere.csv")  # O_CREAT would create the link's target: refused instead
    with pytest.raises(LinkedFile, match="a symbolic link"):
        appended(dangling)
    assert victim.read_text() == "keep me\n" and not (tmp_path / "nowhere.csv").exists()


def test_links_of_either_kind_are_found_and_plain_files_are_not(tmp_path, victim):
    (tmp_path / "plain.txt").write_text("x")
    (tmp_path / "soft").symlink_to(victim)
    (tmp_path / "hard").hardlink_to(victim)
    (tmp_path / "folder").mkdir()
    found = {entry.name for entry in os.scandir(tmp_path) if linked(entry)}
    assert found == {"soft", "hard"}
