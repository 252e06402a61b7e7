"""How `mergeflow serve` words an outage of the Prefect server: one warning when it goes away, one line when it is
back, and a server still shutting down is not yet back."""

import httpx

from mergeflow.deployments.serve import ANSWERS_TO_BE_BACK, ServerOutages


def outages_saying_into(lines: list[str]) -> ServerOutages:
    return ServerOutages(lines.append)


def test_an_outage_is_one_warning_however_many_errors_it_raises():
    lines: list[str] = []
    outages = outages_saying_into(lines)

    for _ in range(3):
        outages.away(httpx.ConnectError("refused"))

    assert len(lines) == 1 and "does not answer (ConnectError)" in lines[0]


def test_one_answer_during_a_shutdown_is_not_yet_the_server_back():
    lines: list[str] = []
    outages = outages_saying_into(lines)
    outages.away(httpx.RemoteProtocolError("closed"))

    outages.answered()
    outages.away(httpx.ConnectError("refused"))

    assert len(lines) == 1


def test_the_server_is_back_after_answering_polls_in_a_row():
    lines: list[str] = []
    outages = outages_saying_into(lines)
    outages.away(httpx.ConnectError("refused"))

    for _ in range(ANSWERS_TO_BE_BACK):
        outages.answered()

    assert lines[-1] == "the Prefect server answers again"


def test_answers_without_an_outage_say_nothing():
    lines: list[str] = []
    outages = outages_saying_into(lines)

    outages.answered()
    outages.answered()

    assert lines == []
