"""Writes train/prompts/seed-prompts.jsonl: original, offline training prompts for draft heads.

Deterministic (python train/prompts/make_seed_prompts.py reproduces the committed file). Covers the
kinds of requests chat models get (writing, role-play, reasoning, arithmetic word problems, coding,
extraction, STEM, humanities) in several phrasings, and Python tasks both as requests and as
function stubs with a docstring. None is taken from an evaluation set; the data pipeline checks that.
"""

import json
import random
from pathlib import Path

TOPICS = """rivers; volcanoes; honeybees; the moon landing; black holes; photosynthesis; the printing press;
coffee; chess; jazz music; the Roman Empire; ancient Egypt; the Silk Road; climate change; recycling;
electric cars; vaccines; sleep; meditation; marathon running; bread baking; fermentation; tea ceremonies;
origami; the stock market; inflation; compound interest; budgeting; renting versus buying a home;
learning a new language; public speaking; job interviews; remote work; time management; procrastination;
friendship; moving to a new city; adopting a dog; keeping houseplants alive; composting; birdwatching;
the water cycle; plate tectonics; the human heart; the immune system; DNA; evolution; antibiotics;
the periodic table; electricity; magnetism; gravity; the speed of light; quantum computing;
machine learning; the internet; encryption; open-source software; databases; video games; social media;
smartphones; 3D printing; renewable energy; nuclear power; the ocean floor; coral reefs; rainforests;
deserts; glaciers; the Arctic; penguins; octopuses; whales; dinosaurs; the Renaissance; the Industrial
Revolution; the French Revolution; democracy; the printing of money; museums; libraries; poetry;
Shakespeare; science fiction; film editing; photography; painting with watercolors; architecture;
bridges; skyscrapers; city planning; public transport; bicycles; trains; aviation; space stations;
Mars exploration; the solar system; comets; telescopes; mathematics in nature; prime numbers;
probability; statistics; game theory; logic puzzles; philosophy of mind; ethics of AI; happiness;
habits; nutrition; vegetarian cooking; spices; chocolate; wine making; olive oil; farming; soil;
weather forecasting; hurricanes; earthquakes; first aid; exercise for beginners; yoga; team sports;
the Olympic Games; board games; magic tricks; stand-up comedy; theatre; opera; classical music;
learning the guitar; writing a novel; journaling; minimalism; fashion history; textiles; pottery;
woodworking; home repair; saving energy at home; volunteering; small business marketing; negotiation;
customer service; leadership; mentoring; teaching children to read; homework help; college applications;
studying for exams; memory techniques; critical thinking; misinformation; privacy online; password safety"""

GENERAL_FORMS = [
    "Explain {t} to a curious beginner.",
    "Write a short story that involves {t}.",
    "Give three practical tips about {t}.",
    "What are common misconceptions about {t}?",
    "Write a persuasive paragraph arguing that everyone should learn about {t}.",
    "Summarize the history of {t} in a few paragraphs.",
    "Write a blog post introduction about {t}.",
    "Compose a short poem about {t}.",
    "What are the pros and cons of {t}? Answer as a list.",
    "Create a five-question quiz about {t} with answers.",
    "Pretend you are a teacher. Give a short lesson on {t}.",
    "Write an email to a friend recommending that they look into {t}.",
]

ROLES = ["a pirate captain", "a medieval knight", "a detective", "a travel guide in Paris", "a chef",
         "a personal fitness coach", "a museum curator", "a startup founder", "an astronaut",
         "a wise old wizard", "a sports commentator", "a kindergarten teacher", "a film critic",
         "a customer support agent", "a tour guide at a science museum", "a librarian"]
ROLE_FORMS = [
    "Pretend you are {r}. Introduce yourself and describe a typical day.",
    "Act as {r} and answer this: what advice would you give someone starting out?",
    "You are {r}. Write a short speech to motivate a group of people.",
]

EXTRACT = [
    ("Extract all the names of people and places from this text: {x}",
     ["Maria flew from Lisbon to Oslo to meet her brother Tomas, and then they drove to Bergen together.",
      "The committee, led by Dr. Aisha Khan, met in Nairobi before visiting the lab in Geneva.",
      "After graduating in Toronto, Li Wei joined a company in Seoul and later moved to Sydney.",
      "Jonas and Petra opened a bakery in Munich; their cousin Elena runs a cafe in Vienna."]),
    ("Summarize the following in one sentence: {x}",
     ["The town council voted to extend the library's opening hours after a survey showed that most "
      "residents wanted evening access, especially students preparing for exams.",
      "Researchers found that people who walked for thirty minutes a day slept better and reported "
      "lower stress, although the effect was smaller in people who already exercised.",
      "The bridge will be closed for repairs for six weeks starting in March; buses will run every "
      "ten minutes on a detour route during the closure."]),
    ("Classify the sentiment of this review as positive, negative or mixed, and explain why: {x}",
     ["The hotel room was spotless and the staff were friendly, but breakfast was cold and overpriced.",
      "Absolutely loved this phone. The battery lasts two days and the camera is superb.",
      "The course promised hands-on projects but it was mostly slides. I would not take it again."]),
    ("Turn this information into a JSON object: {x}",
     ["Name: Sam Ortiz, age 34, city Denver, hobbies hiking and chess, member since 2019.",
      "Product: desk lamp, price 24.99 dollars, colors black and white, in stock: yes.",
      "Flight BA117 departs London at 10:40 and arrives in New York at 13:25 local time."]),
]


def word_problems(rng: random.Random, n: int) -> list[str]:
    forms = [
        lambda: f"A shop sells pencils for {rng.randint(2, 9)} cents each. How much do {rng.randint(12, 80)} pencils cost? Explain your steps.",
        lambda: f"A train travels {rng.randint(60, 400)} kilometers in {rng.randint(2, 6)} hours. What is its average speed?",
        lambda: f"If a rectangle is {rng.randint(3, 30)} cm long and {rng.randint(2, 20)} cm wide, what are its area and perimeter?",
        lambda: f"Solve for x: {rng.randint(2, 9)}x + {rng.randint(1, 30)} = {rng.randint(31, 120)}. Show your work.",
        lambda: f"What is {rng.randint(11, 99)} percent of {rng.randint(100, 900)}?",
        lambda: f"Tom has {rng.randint(5, 40)} apples. He gives away {rng.randint(1, 5)} to each of his {rng.randint(2, 6)} friends. How many are left?",
        lambda: f"A recipe needs {rng.randint(2, 5)} eggs for {rng.randint(4, 8)} people. How many eggs are needed for {rng.randint(10, 30)} people?",
        lambda: f"Is {rng.randint(50, 500)} a prime number? Explain how you check.",
        lambda: f"What is the sum of the integers from 1 to {rng.randint(10, 200)}? Explain the shortcut.",
        lambda: f"A savings account pays {rng.randint(2, 8)}% interest per year. If you deposit {rng.randint(1, 9) * 100} dollars, how much will you have after {rng.randint(2, 5)} years with annual compounding?",
        lambda: f"Three friends split a bill of {rng.randint(30, 150)} dollars and add a {rng.randint(10, 20)}% tip. How much does each pay?",
        lambda: f"If today is {rng.choice(['Monday', 'Tuesday', 'Friday', 'Sunday'])}, what day of the week will it be in {rng.randint(10, 100)} days?",
        lambda: "Alice is older than Bob. Bob is older than Carol. Is Carol older than Alice? Explain your reasoning.",
        lambda: f"A bag has {rng.randint(2, 9)} red and {rng.randint(2, 9)} blue marbles. What is the probability of drawing a red one?",
        lambda: f"Convert {rng.randint(1, 40)} degrees Celsius to Fahrenheit and explain the formula.",
    ]
    return [rng.choice(forms)() for _ in range(n)]


# (function name, arguments, description)
CODE_TASKS = [
    ("reverse_words", "sentence: str", "Return the sentence with the order of its words reversed."),
    ("count_vowels", "text: str", "Return the number of vowels in the text, ignoring case."),
    ("is_palindrome", "text: str", "Return True if the text reads the same backwards, ignoring spaces and case."),
    ("fizzbuzz", "n: int", "Return a list of strings for 1..n with Fizz for multiples of 3, Buzz for 5, FizzBuzz for both."),
    ("flatten", "nested: list", "Flatten an arbitrarily nested list of integers into a flat list."),
    ("second_largest", "numbers: list", "Return the second largest distinct number, or None if there is none."),
    ("merge_sorted", "a: list, b: list", "Merge two sorted lists into one sorted list in linear time."),
    ("word_frequencies", "text: str", "Return a dict mapping each lowercase word to how often it occurs."),
    ("running_sum", "numbers: list", "Return the list of prefix sums of the numbers."),
    ("gcd", "a: int, b: int", "Return the greatest common divisor of a and b."),
    ("lcm", "a: int, b: int", "Return the least common multiple of two positive integers."),
    ("is_prime", "n: int", "Return True if n is a prime number."),
    ("primes_up_to", "n: int", "Return all primes less than or equal to n using a sieve."),
    ("fibonacci", "n: int", "Return the n-th Fibonacci number, with fibonacci(0) == 0."),
    ("factorial", "n: int", "Return n factorial for a non-negative integer n."),
    ("binary_search", "items: list, target: int", "Return the index of target in the sorted list, or -1."),
    ("chunk", "items: list, size: int", "Split the list into consecutive chunks of the given size."),
    ("unique_in_order", "items: list", "Remove duplicates while keeping the first occurrence order."),
    ("capitalize_words", "text: str", "Capitalize the first letter of every word."),
    ("anagrams", "a: str, b: str", "Return True if the two strings are anagrams of each other."),
    ("digit_sum", "n: int", "Return the sum of the decimal digits of a non-negative integer."),
    ("to_binary", "n: int", "Return the binary representation of a non-negative integer as a string."),
    ("roman_numeral", "n: int", "Convert an integer from 1 to 3999 to a Roman numeral."),
    ("parse_roman", "s: str", "Convert a Roman numeral string to an integer."),
    ("transpose", "matrix: list", "Return the transpose of a rectangular matrix given as a list of lists."),
    ("matrix_multiply", "a: list, b: list", "Multiply two matrices given as lists of lists."),
    ("rotate_list", "items: list, k: int", "Rotate the list to the right by k positions."),
    ("longest_word", "sentence: str", "Return the longest word; on ties return the first one."),
    ("count_substrings", "text: str, sub: str", "Count possibly overlapping occurrences of sub in text."),
    ("caesar_cipher", "text: str, shift: int", "Shift every letter by shift positions, keeping case and other characters."),
    ("valid_parentheses", "s: str", "Return True if every bracket in s is closed in the right order."),
    ("median", "numbers: list", "Return the median of a non-empty list of numbers."),
    ("mode", "numbers: list", "Return the most common value; on ties return the smallest."),
    ("normalize", "values: list", "Scale the values linearly so that they lie between 0 and 1."),
    ("dot_product", "a: list, b: list", "Return the dot product of two equal-length vectors."),
    ("pairs_with_sum", "numbers: list, target: int", "Return all pairs of indices whose values add up to target."),
    ("max_subarray", "numbers: list", "Return the largest sum of a contiguous subarray."),
    ("remove_punctuation", "text: str", "Return the text without punctuation characters."),
    ("snake_to_camel", "name: str", "Convert snake_case to camelCase."),
    ("camel_to_snake", "name: str", "Convert camelCase to snake_case."),
    ("group_by_length", "words: list", "Group words into a dict keyed by word length."),
    ("invert_dict", "d: dict", "Swap keys and values; values are assumed to be unique."),
    ("deep_get", "d: dict, path: str", "Follow a dotted path like 'a.b.c' through nested dicts and return the value or None."),
    ("count_islands", "grid: list", "Count groups of connected 1s in a grid of 0s and 1s (4-neighbourhood)."),
    ("matrix_spiral", "matrix: list", "Return the elements of a matrix in spiral order."),
    ("is_leap_year", "year: int", "Return True if the year is a leap year in the Gregorian calendar."),
    ("days_between", "a: str, b: str", "Return the number of days between two ISO dates like '2024-01-31'."),
    ("celsius_table", "start: int, stop: int", "Return a list of (celsius, fahrenheit) pairs for the range."),
    ("run_length_encode", "text: str", "Compress runs of repeated characters, e.g. 'aaab' -> 'a3b1'."),
    ("run_length_decode", "text: str", "Invert run_length_encode."),
    ("power_set", "items: list", "Return all subsets of the list."),
    ("permutations", "items: list", "Return all orderings of the list without using itertools."),
    ("bubble_sort", "numbers: list", "Sort the list with bubble sort and return a new list."),
    ("insertion_sort", "numbers: list", "Sort the list with insertion sort and return a new list."),
    ("quicksort", "numbers: list", "Sort the list with quicksort and return a new list."),
    ("kth_smallest", "numbers: list, k: int", "Return the k-th smallest element (1-based)."),
    ("common_prefix", "words: list", "Return the longest common prefix of the words."),
    ("count_words", "path: str", "Return the number of words in the text file at path."),
    ("moving_average", "values: list, window: int", "Return the moving averages over the given window size."),
    ("clamp", "x: float, low: float, high: float", "Limit x to the interval [low, high]."),
    ("hamming_distance", "a: str, b: str", "Return the number of positions where two equal-length strings differ."),
    ("balanced_split", "numbers: list", "Return True if the list can be split into two parts with equal sums."),
    ("triangle_type", "a: float, b: float, c: float", "Return 'equilateral', 'isosceles', 'scalene' or 'invalid'."),
    ("sum_of_squares", "n: int", "Return 1*1 + 2*2 + ... + n*n."),
    ("vowel_positions", "word: str", "Return the indices at which the word has a vowel."),
    ("email_is_valid", "address: str", "Return True for a simple valid email address with one @ and a dot in the domain."),
    ("histogram", "values: list", "Return a text histogram with one line of stars per distinct value."),
    ("nth_row_pascal", "n: int", "Return the n-th row of Pascal's triangle."),
    ("collatz_steps", "n: int", "Return how many Collatz steps it takes to reach 1 from n."),
    ("perfect_numbers", "limit: int", "Return all perfect numbers below limit."),
    ("even_odd_split", "numbers: list", "Return a tuple (evens, odds) keeping the original order."),
    ("title_case", "text: str", "Title-case the text but keep short words like 'of' and 'and' lowercase except at the start."),
    ("char_histogram", "text: str", "Return a dict of character counts, ignoring spaces."),
    ("find_duplicates", "items: list", "Return the values that appear more than once, in first-seen order."),
    ("staircase", "n: int", "Return a string drawing of a right-aligned staircase of height n using '#'."),
    ("digits_to_words", "n: int", "Spell each digit of n as an English word, separated by spaces."),
    ("lru_cache_class", "capacity: int", "Implement a small LRU cache class with get and put methods."),
    ("stack_class", "", "Implement a Stack class with push, pop, peek and is_empty."),
    ("queue_with_two_stacks", "", "Implement a queue using two stacks with enqueue and dequeue."),
    ("linked_list_reverse", "head", "Reverse a singly linked list given its head node and return the new head."),
]

CODE_FORMS = [
    "Write a Python function `{name}({args})`. {desc} Include a short docstring and an example.",
    "In Python, how would I {ldesc} Please write the code and explain it.",
    "Implement this in Python:\n\ndef {name}({args}):\n    \"\"\"{desc}\"\"\"\n",
    "Complete the following Python function.\n\ndef {name}({args}):\n    \"\"\"{desc}\n    \"\"\"\n",
    "Write unit tests with pytest for a function `{name}({args})` that does this: {desc}",
    "Explain, step by step, an efficient algorithm for this task and give its time complexity: {desc}",
]

OTHER_LANGS = ["JavaScript", "C++", "Java", "Go", "Rust", "SQL"]


def main():
    rng = random.Random(0)
    topics = [t.strip() for t in TOPICS.replace("\n", " ").split(";") if t.strip()]
    prompts = []
    for t in topics:
        for form in rng.sample(GENERAL_FORMS, 4):
            prompts.append(form.format(t=t))
    for r in ROLES:
        for form in ROLE_FORMS:
            prompts.append(form.format(r=r))
    for form, xs in EXTRACT:
        for x in xs:
            prompts.append(form.format(x=x))
    prompts += word_problems(rng, 160)
    for name, args, desc in CODE_TASKS:
        ldesc = desc[0].lower() + desc[1:]
        for form in rng.sample(CODE_FORMS, 3):
            prompts.append(form.format(name=name, args=args, desc=desc, ldesc=ldesc))
        lang = rng.choice(OTHER_LANGS)
        prompts.append(f"Write this in {lang}: {desc}")
    seen, out = set(), []
    for p in prompts:
        if p not in seen:
            seen.add(p)
            out.append(p)
    rng.shuffle(out)
    path = Path(__file__).with_name("seed-prompts.jsonl")
    with open(path, "w") as f:
        for p in out:
            f.write(json.dumps({"prompt": p}) + "\n")
    print(f"{len(out)} prompts -> {path}")


if __name__ == "__main__":
    main()
