"""Long retrieved passages: cut at their beginning, or (model.passage_focus) around what the conversation is about."""

from clarifier.core.prompt import PromptOptions, focus_passage, render_user_message
from clarifier.core.schema import Passage, Turn

STORY = ("It was in 1865 that two Frenchmen were looking into the future. Bartholdi was a famous artist. "
         "He visited the United States in 1871 and saw the perfect place for a huge statue on an island. "
         "During the celebration in 1876 the arm of the statue that would hold the torch was shown in Philadelphia. "
         "In 1879 the huge head was put on display in France. The statue was finally completed in 1884. "
         "It left France in pieces in May 1885 and arrived in June.")


def test_a_passage_that_fits_is_shown_whole():
    assert focus_passage("  Short   passage. Two sentences. ", 300, ["anything"]) == "Short passage. Two sentences."


def test_a_long_passage_shows_the_sentences_the_conversation_is_about():
    shown = focus_passage(STORY, 120, ["What year was that?", "The arm of the statue", "What was displayed?"])
    assert len(shown) <= 120
    assert "the arm of the statue that would hold the torch" in shown
    assert shown.startswith("…") and shown.endswith("…")  # text left out on both sides is marked
    assert "1865" not in shown  # the beginning, which a plain cut would show, is not what the turns are about


def test_the_latest_message_outweighs_older_turns():
    shown = focus_passage(STORY, 80, ["When did the head go on display?", "It was shown in Philadelphia"])
    assert "head was put on display" in shown


def test_no_shared_word_falls_back_to_the_beginning_and_a_long_sentence_is_cut():
    assert focus_passage(STORY, 60, ["zebra xylophone"]) == STORY[:59].rstrip() + "…"
    one = "word " * 100
    assert focus_passage(one, 50, ["word"]) == ("word " * 10)[:49].rstrip() + "…"
    last = "Unrelated opening sentence here. " + "The statue " * 20 + "ends."  # the best sentence is the last one
    shown = focus_passage(last, 60, ["statue"])
    assert shown.startswith("…The statue") and shown.endswith("…") and len(shown) <= 60


def test_the_renderer_focuses_only_when_asked_and_uses_the_shown_history():
    history = [Turn(role="user", text="Tell me about the statue"), Turn(role="assistant", text="The arm of the statue")]
    passages = [Passage(id="p1", text=STORY)]
    plain = render_user_message(history, "What year was that?", passages, PromptOptions(max_passage_chars=120))
    focused = render_user_message(history, "What year was that?", passages,
                                  PromptOptions(max_passage_chars=120, passage_focus=True))
    assert "[p1] It was in 1865" in plain and "the arm of the statue" not in plain.split("[p1]")[1].split("\n")[0]
    assert "the arm of the statue that would hold the torch" in focused.split("[p1]")[1].split("\n")[0]
