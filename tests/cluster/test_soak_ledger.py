"""The soak's ledger (bench/soak_ledger.py): which sources a greedy probe may answer with while admin calls
overlap it. CI's soak once failed a right answer: a probe went out, a re-point of its name went out before
the probe's answer, the server switched and answered with the new weights, and the ledger, which learned the
new source only at the re-point's 200, allowed the old one alone."""

from __future__ import annotations

from bench.soak_ledger import Book

OLD, NEW, BROKEN = "/a/demo-chat", "/a/demo-translate", "/a/broken-nan"


def _book_with(name: str, uri: str) -> Book:
    book = Book({"base": None, "demo-sql": "/cache/demo-sql"})
    book.end(name, "load", uri, True, book.begin(name, "load"))
    return book


def test_no_re_point_overlapping_allows_only_the_believed_source():
    book = _book_with("soak-6", OLD)
    sent = book.sent("soak-6")
    assert book.expected(sent) == 200
    assert book.sources_during(sent) == {OLD}
    assert book.sources_during(book.sent("demo-sql")) == {"/cache/demo-sql"}


def test_a_re_point_sent_before_the_answer_allows_its_target_before_its_200_comes_back():
    book = _book_with("soak-6", OLD)
    sent = book.sent("soak-6")
    token = book.begin("soak-6", "repoint", NEW)
    assert book.sources_during(sent) == {OLD, NEW}  # the CI case: answered while the re-point was in flight
    book.end("soak-6", "repoint", NEW, True, token)
    assert book.sources_during(sent) == {OLD, NEW}
    assert book.sources_during(book.sent("soak-6")) == {NEW}  # after the 200: the new source only


def test_a_re_point_in_flight_when_the_request_went_out_allows_its_target():
    book = _book_with("soak-6", OLD)
    token = book.begin("soak-6", "repoint", NEW)
    sent = book.sent("soak-6")
    assert book.sources_during(sent) == {OLD, NEW}
    book.end("soak-6", "repoint", NEW, True, token)
    assert book.sources_during(sent) == {OLD, NEW}


def test_a_refused_re_point_leaves_the_old_source_once_answered():
    book = _book_with("soak-6", OLD)
    token = book.begin("soak-6", "repoint", BROKEN)
    during = book.sent("soak-6")
    book.end("soak-6", "repoint", BROKEN, False, token)
    assert book.sources_during(during) == {OLD, BROKEN}  # in flight at send: the client could not know yet
    assert book.sources_during(book.sent("soak-6")) == {OLD}


def test_a_load_or_unload_overlapping_makes_the_status_unknown():
    book = _book_with("soak-6", OLD)
    sent = book.sent("soak-6")
    token = book.begin("soak-6", "unload")
    assert book.expected(sent) is None and book.sources_during(sent) is None
    book.end("soak-6", "unload", None, True, token)
    assert book.expected(book.sent("soak-6")) == 404
