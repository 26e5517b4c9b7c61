"""bench.retrieval.conversations' multi-turn set: a subject, then a terse follow-up by pronoun."""

from __future__ import annotations

from bench.retrieval.conversations import _third_person, build_conversations
from specrag.retrieval.corpus import Passage


def test_a_docstring_sentence_becomes_a_terse_question() -> None:
    assert _third_person("Return the value of the key.", 4) == "returns the value"
    assert _third_person("Push a line to the interpreter.", 4) == "pushes a line"
    assert _third_person("Copy the data if needed.", 4) == "copies the data"
    assert _third_person("This class does things.", 4) is None  # not an imperative verb


def test_each_conversation_names_its_subject_then_refers_to_it() -> None:
    passages = [
        Passage(
            "doc/ftplib#0", "Python standard library: ftplib", "ftplib: An FTP client class and some helpers."
        ),
        Passage(
            "doc/ftplib#1",
            "Python standard library: ftplib",
            "ftplib.FTP: An FTP client class that talks to a server.\n\n"
            "ftplib.FTP.sendeprt: Send an EPRT command with the current host.\n\n"
            "ftplib.parse227: Parse the '227' response for a PASV request.",
        ),
    ]
    conversations = build_conversations(passages, count=10)
    turns = {(c.first.question, c.follow_up.question, c.follow_up.passage_id) for c in conversations}
    assert turns == {
        (
            "What is the class `FTP` of the module `ftplib` for?",
            "And which of its methods sends an EPRT command?",
            "doc/ftplib#1",
        ),
        (
            "What is the module `ftplib` for?",
            "And which of its functions parses the '227' response?",
            "doc/ftplib#1",
        ),
    }
