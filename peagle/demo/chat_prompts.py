"""Chat prompts shaped like what people ask an instruct model, made here (nothing is downloaded).

The demo and the quality benchmark need prompts for a real instruct target (SmolLM2-135M-Instruct):
the target writes the answers itself (``peagle extract --regenerate``), so only the user turns are
needed, and what matters for a draft is that they are *varied*: many kinds of request (explain, how
to, code, lists, comparisons, stories and poems, definitions, arithmetic, rewriting, emails, and
follow-up questions) over many subjects, so a draft that memorises its training answers gains
nothing on held-out ones.

Each prompt is (kind, subject, phrasing). The train / held-out split is by *subject* (a hash of kind
and subject), so no held-out question has a twin about the same subject in training, only other
subjects asked the same ways: what a deployed draft faces. The lists are a pure function of this
file: every machine makes the same prompts.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

CONCEPTS = (
    "photosynthesis", "inflation", "black holes", "the water cycle", "machine learning", "blockchain", "vaccines",
    "climate change", "supply and demand", "the immune system", "gravity", "evolution by natural selection",
    "compound interest", "the greenhouse effect", "DNA replication", "plate tectonics", "the internet", "encryption",
    "democracy", "the stock market", "electric cars", "nuclear fusion", "recursion", "the French Revolution",
    "the Renaissance", "quantum computing", "antibiotics", "the placebo effect", "opportunity cost", "entropy",
    "the speed of light", "solar panels", "tides", "earthquakes", "the Roman Empire", "cloud computing",
    "neural networks", "the carbon cycle", "the circulatory system", "sleep", "memory in the brain",
    "operating systems", "compilers", "databases", "version control", "the scientific method", "probability",
    "statistics", "the Pythagorean theorem", "prime numbers", "the Big Bang", "rainbows", "magnetism",
    "electricity", "batteries", "the Industrial Revolution", "globalization", "taxes", "interest rates",
    "the Cold War", "the printing press", "photosynthesis in algae", "coral reefs", "the ozone layer",
    "hurricanes", "volcanoes", "the moon's phases", "seasons on Earth", "caffeine", "meditation",
)
TASKS = (
    "learn a new language", "start running", "make bread at home", "save money each month", "write a resume",
    "prepare for a job interview", "plant a vegetable garden", "improve my handwriting", "learn to play guitar",
    "clean a laptop keyboard", "change a flat tyre", "make a good cup of coffee", "study for an exam",
    "organise my closet", "start a podcast", "train a puppy", "reduce screen time", "learn to code",
    "write a cover letter", "plan a trip to Japan", "set up a home network", "back up my photos",
    "make friends in a new city", "get better at public speaking", "cook rice", "fall asleep faster",
    "keep houseplants alive", "negotiate a salary", "start a small business", "learn to swim", "make a budget",
    "improve my posture", "write a short story", "read more books", "stop procrastinating", "brew tea properly",
    "choose a laptop", "paint a room", "learn chess", "make pancakes", "stay focused while working from home",
    "memorise a speech", "take better photos with my phone", "fix a leaking tap", "make a website",
)
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "removes duplicates from a list", "merges two sorted lists",
    "computes the factorial of a number", "finds the largest element in a list", "checks if a word is a palindrome",
    "flattens a nested list", "sorts a list of dictionaries by a key", "converts Celsius to Fahrenheit",
    "counts word frequencies in a text", "returns the greatest common divisor of two numbers",
    "checks whether two strings are anagrams", "reads a CSV file and returns its rows", "computes the average of a list",
    "finds the second largest number in a list", "capitalises every word in a sentence", "validates an email address",
    "returns all even numbers from a list", "implements binary search", "computes the sum of digits of a number",
    "rotates a list by k positions", "transposes a matrix", "groups words by their first letter",
    "converts a decimal number to binary", "finds the longest word in a sentence", "checks for balanced parentheses",
    "implements bubble sort", "counts lines in a file", "generates a random password", "computes a running total",
    "finds common elements of two lists", "returns the median of a list", "chunks a list into groups of n",
    "checks whether a year is a leap year", "converts a string to snake_case", "implements a simple stack class",
    "computes the dot product of two vectors",
)
ACTIVITIES = (
    "staying healthy", "learning faster", "working from home", "travelling on a budget", "saving energy at home",
    "writing clearly", "managing stress", "eating well", "staying productive", "running a meeting",
    "taking care of a cat", "studying math", "keeping a journal", "reducing waste", "camping",
    "giving feedback", "learning to draw", "hosting a dinner party", "moving house", "being a good listener",
    "writing emails", "debugging code", "driving in the rain", "staying motivated", "cooking for one",
)
PAIRS = (
    ("a virus", "a bacterium"), ("weather", "climate"), ("a list", "a tuple in Python"), ("RAM", "storage"),
    ("stocks", "bonds"), ("a crocodile", "an alligator"), ("speed", "velocity"), ("TCP", "UDP"),
    ("a simile", "a metaphor"), ("mitosis", "meiosis"), ("an atom", "a molecule"), ("HTTP", "HTTPS"),
    ("a debit card", "a credit card"), ("baking soda", "baking powder"), ("a comet", "an asteroid"),
    ("socialism", "capitalism"), ("a lake", "a pond"), ("Python", "JavaScript"), ("affect", "effect"),
    ("a hurricane", "a tornado"), ("machine learning", "deep learning"), ("latitude", "longitude"),
    ("a frog", "a toad"), ("an LED", "an incandescent bulb"), ("SQL", "NoSQL databases"),
    ("a recession", "a depression"), ("a violin", "a viola"), ("empathy", "sympathy"), ("a CPU", "a GPU"),
    ("renting", "buying a home"),
)
THINGS = (
    "the ocean", "autumn leaves", "a lonely robot", "a city at night", "the first day of school", "a lost key",
    "a dragon who is afraid of fire", "a lighthouse keeper", "coffee", "the moon", "a rainy Sunday", "friendship",
    "a old bicycle", "a cat who wants to fly", "the last tree on Earth", "a time traveller", "winter mornings",
    "a small village", "the stars", "a garden in spring", "a message in a bottle", "a forgotten library",
    "mountains", "a talking dog", "the sound of rain",
)
ENTITIES = (
    "the Eiffel Tower", "the Amazon rainforest", "Mount Everest", "the Great Wall of China", "the Sahara desert",
    "the Moon", "Mars", "Jupiter", "the Pacific Ocean", "the Nile", "Python (the programming language)", "Linux",
    "Wikipedia", "the United Nations", "the Olympic Games", "a haiku", "a sonnet", "jazz", "the violin", "chess",
    "sushi", "the Mona Lisa", "the Colosseum", "Antarctica", "the Milky Way", "a neutron star", "a kangaroo",
    "an octopus", "the honey bee", "the Internet Protocol",
)
PEOPLE = (
    "Albert Einstein", "Marie Curie", "Isaac Newton", "Ada Lovelace", "Leonardo da Vinci", "William Shakespeare",
    "Charles Darwin", "Nikola Tesla", "Alan Turing", "Cleopatra", "Galileo Galilei", "Jane Austen", "Mozart",
    "Napoleon Bonaparte", "Florence Nightingale", "Confucius", "Aristotle", "Frida Kahlo", "Grace Hopper",
    "Johannes Gutenberg",
)
SENTENCES = (
    "hey, can u send me the report asap", "the meeting got moved cause the boss was sick",
    "i think we should maybe try a different approach or something", "this product is really good and i like it a lot",
    "we gonna be late so dont wait for us", "the results was not what we expected",
    "pls let me know if u have questions", "our team did great this year and made lots of money",
    "the app keeps crashing and its super annoying", "thanks for the help yesterday, it was awesome",
    "can we talk about the budget thing tomorrow", "the food at the party was kinda cold",
)
RECIPIENTS = (
    "my manager", "a new client", "my landlord", "a teacher", "the support team", "a colleague", "my neighbour",
    "a hiring manager", "the school principal", "a supplier",
)
EMAIL_SUBJECTS = (
    "a late delivery", "asking for a day off", "a broken heater", "thanking them for their help",
    "rescheduling a meeting", "a project update", "a job application", "a billing mistake", "a team lunch",
    "feedback on a presentation",
)
FOLLOW_UPS = ("Can you give an example?", "Explain it more simply.", "Why does that matter?", "Can you make it shorter?",
              "What are the most common mistakes?")

PHRASINGS = {
    "explain": ("Explain {s} in simple terms.", "What is {s}?", "Can you explain how {s} works?",
                "Give me a short explanation of {s}.", "I never understood {s}. Can you help?"),
    "howto": ("How do I {s}?", "What is the best way to {s}?", "Give me step-by-step instructions to {s}.",
              "I want to {s}. Where should I start?"),
    "code": ("Write a Python function that {s}.", "Can you write Python code that {s}?",
             "Show me a Python function which {s}, with a short explanation.", "Implement a function in Python that {s}."),
    "tips": ("Give me five tips for {s}.", "What are some good tips for {s}?", "List three ideas for {s}.",
             "What should I keep in mind when {s}?"),
    "compare": ("What is the difference between {a} and {b}?", "Compare {a} and {b}.",
                "How is {a} different from {b}?", "{A} or {b}: what sets them apart?"),
    "creative": ("Write a short poem about {s}.", "Write a short story about {s}.", "Write a haiku about {s}.",
                 "Tell me a short, funny story about {s}.", "Describe {s} in a few vivid sentences."),
    "facts": ("Tell me about {s}.", "What is {s} known for?", "Give me three interesting facts about {s}.",
              "Write a short paragraph about {s}."),
    "people": ("Who was {s}?", "What is {s} famous for?", "Write a short biography of {s}.",
               "Why is {s} important in history?"),
    "rewrite": ("Rewrite this sentence to sound more professional: \"{s}\"", "Fix the grammar of: \"{s}\"",
                "Make this more polite: \"{s}\""),
    "email": ("Write a short email to {a} about {b}.", "Draft a polite email to {a} regarding {b}.",
              "Help me write an email to {a} about {b}."),
    "math": ("What is {x} times {y}?", "What is {x} plus {y}? Show your work.",
             "A train travels {x} km in {h} hours. What is its average speed?",
             "If I buy {h} items at {y} dollars each, how much do I pay?", "What is {p} percent of {x}?"),
}
"""How each kind of request is asked. Every subject is asked one or more of its kind's phrasings."""


@dataclass(frozen=True)
class Prompt:
    kind: str
    subject: str
    text: str
    follow_up: str | None = None

    def messages(self) -> list[dict]:
        """The chat to regenerate: the question, an (empty) answer the target writes, and for some a
        follow-up question whose answer the target writes too."""
        out = [{"role": "user", "content": self.text}, {"role": "assistant", "content": ""}]
        if self.follow_up:
            out += [{"role": "user", "content": self.follow_up}, {"role": "assistant", "content": ""}]
        return out


def _subjects() -> list[tuple[str, dict]]:
    """(kind, fields) of every subject, in a fixed order."""
    out: list[tuple[str, dict]] = []
    out += [("explain", {"s": s}) for s in CONCEPTS]
    out += [("howto", {"s": s}) for s in TASKS]
    out += [("code", {"s": s}) for s in CODE_TASKS]
    out += [("tips", {"s": s}) for s in ACTIVITIES]
    out += [("compare", {"a": a, "b": b, "A": a[:1].upper() + a[1:]}) for a, b in PAIRS]
    out += [("creative", {"s": s}) for s in THINGS]
    out += [("facts", {"s": s}) for s in ENTITIES]
    out += [("people", {"s": s}) for s in PEOPLE]
    out += [("rewrite", {"s": s}) for s in SENTENCES]
    rng = random.Random(7)
    out += [("email", {"a": a, "b": b}) for a, b in rng.sample([(a, b) for a in RECIPIENTS for b in EMAIL_SUBJECTS], 30)]
    out += [("math", {"x": rng.randint(12, 999), "y": rng.randint(3, 99), "h": rng.randint(2, 9),
                      "p": rng.choice((5, 10, 15, 20, 25, 40, 75))}) for _ in range(60)]
    return out


def _key(kind: str, fields: dict) -> str:
    return kind + ":" + "|".join(f"{k}={fields[k]}" for k in sorted(fields))


def is_heldout(kind: str, fields: dict, heldout_share: float) -> bool:
    """Whether a subject belongs to the held-out split (a hash of kind and subject, so stable)."""
    digest = hashlib.sha256(_key(kind, fields).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < heldout_share


def chat_prompts(*, split: str, seed: int = 0, heldout_share: float = 0.15, follow_up_share: float = 0.25,
                 phrasings_per_subject: int = 2) -> list[Prompt]:
    """Prompts of one split (``train`` or ``heldout``), shuffled by ``seed``.

    Each subject is asked ``phrasings_per_subject`` of its kind's phrasings (distinct ones, chosen by
    ``seed``); about ``follow_up_share`` of the training prompts carry a follow-up question, so the
    target also answers in a multi-turn context. Held-out prompts are single questions (evaluation
    decodes one answer).
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, got {split!r}")
    rng = random.Random(seed)
    out = []
    for kind, fields in _subjects():
        if is_heldout(kind, fields, heldout_share) != (split == "heldout"):
            continue
        phrasings = PHRASINGS[kind]
        for template in rng.sample(phrasings, min(phrasings_per_subject, len(phrasings))):
            text = template.format(**fields)
            follow = rng.choice(FOLLOW_UPS) if split == "train" and rng.random() < follow_up_share else None
            out.append(Prompt(kind, _key(kind, fields), text, follow))
    rng.shuffle(out)
    return out
