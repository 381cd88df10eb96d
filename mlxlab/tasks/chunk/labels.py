"""Chunk labels for joined ShareGPT conversations, which carry no titles: a label from the user
message that opens a chunk (`label_of`), its request boilerplate and greetings taken off."""

from __future__ import annotations

import re

from mlxlab.tasks.chunk.sharegpt_clean import FENCE

# ------------------------------------------------------------------------------ labels

LABEL_MIN_WORDS, LABEL_MAX_WORDS = 2, 9
# English function words, never a label's content word (`_content_words`)
STOP_EN = frozenset(
    """the a an and or but if of to in on at for with from by as is are was were be been being
    it its this that these those i you he she we they me my your our their his her them us do
    does did not no yes can could would should will shall may might must have has had what which
    who whom whose when where why how there here so than then too very just also about into over
    under again more most some any all each other such only own same both few many much one two
    out up down off please write give make like know want need use get tell explain""".split()
)
GREETING = re.compile(
    r"^(?:(?:hi|hello|hey|hiya|greetings|dear|good (?:morning|afternoon|evening)|ok(?:ay)?|"
    r"so|well|alright|now)\b[\s,!.:;-]*(?:there|chatgpt|chat gpt|gpt|assistant|bot|ai|friend|"
    r"again)?\b[\s,!.:;-]*)+",
    re.I,
)
BOILERPLATE_PREFIXES = [
    r"(?:can|could|would|will|won't|wouldn't) you(?: please| kindly| possibly)?",
    r"please|kindly|pls|plz|now|also|then|first|firstly",
    r"i (?:would like|'d like|want|need|wanna|wish|am going|'m going|have|had)(?: for)?(?: you)?"
    r"(?: to)?",
    r"(?:can|could|may) i (?:get|have|see|ask)(?: you)?(?: for| about)?",
    r"i(?:'m| am) (?:looking for|trying to|wondering|curious|interested in|planning to)"
    r"(?: about| if| whether| how| to)?",
    r"(?:help|assist) me(?: to| with| in| out with)?",
    r"(?:let'?s|let us)",
    r"(?:tell|show|teach|give|provide|send|get|find|offer) (?:me|us)(?: with)?(?: about)?",
    r"(?:tell|talk|speak) (?:me )?about",
    r"do you know(?: about| of)?|have you (?:heard of|seen)|are you (?:familiar with|aware of)"
    r"|are you (?:able|capable) (?:to|of)|is it possible (?:to|for you to)|is there a way to",
    r"i have (?:a|some|one) (?:question|questions|query)(?: about| on| for you| regarding)?"
    r"|(?:quick )?question(?: for you)?[:,-]?",
    r"(?:write|create|generate|make|draft|compose|produce|prepare|design|build|develop|"
    r"come up with|suggest|recommend|list|explain|describe|summari[sz]e|outline|define|"
    r"brainstorm|plan|elaborate on|discuss|compare|analy[sz]e|give|provide)(?: me| for me| to me| us)?",
    r"(?:what|who) (?:is|are|was|were|'s)(?: the)?(?: best| main| most)?",
    r"what's(?: the)?",
    r"(?:a |an |some |the )?(?:list|few|couple) of",
]
BOILERPLATE = re.compile(r"^(?:" + "|".join(BOILERPLATE_PREFIXES) + r")\b[\s,:;-]*", re.I)
HOW_DO_I = re.compile(
    r"^how (?:do|can|should|would|could|might|shall) (?:i|we|you|one|someone|people) ", re.I
)
DETERMINERS = {"a", "an", "the", "some", "any", "me", "us", "to"}
TRAILING = {
    "a",
    "an",
    "and",
    "as",
    "at",
    "by",
    "for",
    "from",
    "in",
    "into",
    "of",
    "on",
    "or",
    "the",
    "to",
    "with",
    "over",
    "its",
    "their",
    "is",
    "are",
    "was",
    "were",
    "that",
    "which",
    "than",
    "some",
    "more",
    "most",
    "all",
    "this",
    "these",
    "not",
    "be",
    "can",
    "could",
    "would",
    "will",
    "should",
    "using",
    "where",
    "when",
    "like",
    "my",
    "your",
    "our",
    "i",
    "you",
    "we",
    "it",
    "about",
    "so",
    "but",
    "if",
    "how",
    "what",
    "why",
    "who",
    "do",
    "does",
    "did",
    "has",
    "have",
    "had",
    "very",
    "just",
    "also",
    "then",
    "me",
    "them",
    "they",
    "he",
    "she",
    "his",
    "her",
}
POINTER = re.compile(r"\b(?:this|these|the following|below)\b", re.I)
PHRASE_BREAKS = frozenset(
    "for in on with to from by at that which who where when because while whose using into".split()
)
GENERIC = frozenset(
    """this that following above below text code article essay paragraph paragraphs question
    questions something thing things stuff help hi hello answer answers sentence sentences word
    words information content example examples prompt prompts task tasks list lists topic topics
    version way ways idea ideas response reply message document file data chat conversation
    please thanks thank okay yes able great good sure hey kind type short long new""".split()
)
VERBS = frozenset(
    """write create generate make draft compose produce prepare design build develop suggest
    recommend explain describe summarize summarise outline define brainstorm plan discuss compare
    analyze analyse rewrite rephrase paraphrase improve correct fix check review translate
    convert continue expand shorten edit revise give provide tell show list read act""".split()
)
URL = re.compile(r"https?://\S+|www\.\S+")
PERSONA = re.compile(
    r"^(?:you are|you're|you will be|you act|act as|imagine (?:you|that)|pretend|assume you|"
    r"as an? |from now on|in this (?:chat|conversation))\b",
    re.I,
)
# "Using the AWS CDK with Python, how would I ...": a comma before a question's head splits the
# clause; an introductory part (a condition, a setting) gives way to the question.
COMMA_QUESTION = re.compile(
    r",\s+(?=(?:how|what|why|which|where|when|who|can you|could you|would you|please|tell me|"
    r"is there|is it|do you)\b)",
    re.I,
)
INTRO = re.compile(
    r"^(?:in|if|for|when|assuming|as|given|with|after|before|since|while|on|at|using|from|by|"
    r"suppose|considering|based on|hi|hello|hey)\b",
    re.I,
)


def _label_units(text: str) -> list[str]:
    """The first clauses of a message that a label can come from: code and links dropped,
    markdown marks dropped, split at line ends, sentence ends, colons and dashes."""
    text = FENCE.sub("\n", text)
    text = URL.sub(" ", text)
    text = re.sub(r"`([^`\n]*)`", r"\1", text)
    text = re.sub(r"[*_#>]+", " ", text)
    units = []
    for line in text.split("\n"):
        line = re.sub(r"^\s*(?:[-+•]|\d+[.)])\s+", "", line)
        for unit in re.split(r"(?<=[.?!;])\s+|[:;?!]\s*|\s[-–—]\s|\.\s*$", line):
            parts = COMMA_QUESTION.split(unit, maxsplit=1)
            if len(parts) == 2:
                unit = parts[1] if INTRO.match(parts[0].strip()) else parts[0]
            unit = unit.strip(" \t\"'“”‘’()[]{},.")
            if unit and not PERSONA.match(unit) and not looks_like_code(unit):
                units.append(unit)
        if len(units) >= 6:
            break
    return units[:6]


CODE_CHARS = frozenset("{}[]<>=;%$\\/|&")


def looks_like_code(unit: str) -> bool:
    """A clause that is code, markup or a path rather than words ("{% extends 'base.html' %}",
    "x = np.array(...)"): over 8% of its characters are code punctuation."""
    return sum(ch in CODE_CHARS for ch in unit) > 0.08 * len(unit)


def _content_words(words: list[str]) -> list[str]:
    return [
        w
        for w in (re.sub(r"[^\w+#.-]", "", x).strip(".-").lower() for x in words)
        if w
        and not w.isdigit()
        and w not in STOP_EN
        and w not in GENERIC
        and w not in VERBS
        and w not in TRAILING
        and len(w) >= 2
    ]


def _phrase_from(unit: str, strip: bool = True) -> list[str]:
    s = GREETING.sub("", unit)
    for _ in range(
        8 if strip else 0
    ):  # boilerplate stacks: "Hi, can you please help me write a ..."
        s2 = BOILERPLATE.sub("", s)
        s2 = HOW_DO_I.sub("how to ", s2)
        if s2 == s:
            break
        s = s2
    words = s.split()
    while words and words[0].lower().strip(",") in DETERMINERS:
        words.pop(0)
    if len(words) > LABEL_MAX_WORDS:  # cut: before a clause or phrase that would be cut short
        words = words[:LABEL_MAX_WORDS]
        breaks = [i for i in range(6, len(words)) if words[i].lower() in PHRASE_BREAKS]
        if breaks:
            words = words[: breaks[-1]]
        while len(words) > LABEL_MIN_WORDS and words[-1].lower().strip(",;:-'\"") in TRAILING:
            words.pop()
    if words:
        words[-1] = words[-1].rstrip(",;:-'\"")
    words = [w for w in words if w]
    text = " ".join(words)
    if text.count("(") > text.count(")"):  # "Interquartile range (IQR": cut before the "("
        head = text[: text.rfind("(")].split()
        words = head if len(head) >= LABEL_MIN_WORDS else text.replace("(", "").split()
    return words


def label_of(text: str) -> str | None:
    """A chunk label from the user message that opens it: the first clause (`_label_units`)
    that, without greetings and request boilerplate ("can you", "please", "I want you to",
    "write", "explain", "what is"...) and leading articles, cut to `LABEL_MAX_WORDS` words and
    without trailing function words, keeps 2+ words and a specific word (not a stop word,
    not an instruction verb, not generic like "text"/"code"/"this"); its first letter upper
    case. A clause that is too short without its boilerplate is tried with it ("What is
    Photon"); clauses that set a persona ("You are a recruiter") are skipped; a comma before a
    question word splits a clause (`COMMA_QUESTION`). None when no clause of the first six
    qualifies."""
    fallback = None
    for unit in _label_units(text):
        for strip in (True, False):  # "What is Photon?": "Photon" is short, "What is Photon" not
            words = _phrase_from(unit, strip)
            if LABEL_MIN_WORDS <= len(words) <= LABEL_MAX_WORDS and _content_words(words):
                label = " ".join(words)
                label = label[:1].upper() + label[1:]
                if len(words) <= 5 and POINTER.search(unit):  # "I heard this joke": what joke?
                    fallback = fallback or label
                    break
                return label
    return fallback
