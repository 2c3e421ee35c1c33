"""Math/reasoning sample corpus: generated problems with step-by-step solutions. Every answer is
checked independently of the steps that derive it (substitution, brute force, the stdlib);
a generator whose answer fails its check raises instead of writing a wrong solution."""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "Ken", "Radia", "Tim"]
ITEMS = ["apples", "notebooks", "cables", "tickets", "bolts", "jars of honey", "seed packets"]


def _frac(q: Fraction) -> str:
    return str(q.numerator) if q.denominator == 1 else f"{q.numerator}/{q.denominator}"


def linear_equation(r: random.Random):
    a = r.choice([i for i in range(-12, 13) if i not in (0, 1)])
    x = Fraction(r.randint(-30, 30), r.choice([1, 1, 1, 2, 3]))
    b = r.randint(-50, 50)
    c = a * x + b
    steps = [f"Subtract {b} from both sides: {a}x = {_frac(c)} - ({b}) = {_frac(c - b)}.",
             f"Divide both sides by {a}: x = {_frac(c - b)} / {a} = {_frac((c - b) / a)}."]
    answer = (c - b) / a
    assert a * answer + b == c, "substitution check"
    return f"Solve for x: {a}x + ({b}) = {_frac(c)}.", steps, _frac(answer)


def shopping(r: random.Random):
    who, item = r.choice(NAMES), r.choice(ITEMS)
    n, price, pct = r.randint(3, 40), r.randint(2, 90), r.choice([5, 10, 15, 20, 25, 30])
    gross = n * price
    discount = Fraction(gross * pct, 100)
    steps = [f"The full price is {n} x {price} = {gross}.",
             f"The discount is {pct}% of {gross} = {_frac(discount)}.",
             f"So {who} pays {gross} - {_frac(discount)} = {_frac(gross - discount)}."]
    assert sum(Fraction(price) for _ in range(n)) * Fraction(100 - pct, 100) == gross - discount
    return (f"{who} buys {n} {item} at {price} dollars each and gets a {pct}% discount on the "
            f"total. How much does {who} pay?", steps, _frac(gross - discount))


def euclid_gcd(r: random.Random):
    g = r.randint(2, 40)
    a, b = g * r.randint(10, 400), g * r.randint(10, 400)
    x, y, steps = max(a, b), min(a, b), []
    while y:
        steps.append(f"{x} = {x // y} x {y} + {x % y}.")
        x, y = y, x % y
    steps.append(f"The last non-zero remainder is {x}.")
    assert x == math.gcd(a, b)
    return f"Use Euclid's algorithm to find gcd({a}, {b}).", steps, str(x)


def fraction_sum(r: random.Random):
    p, q = Fraction(r.randint(1, 20), r.randint(2, 15)), Fraction(r.randint(1, 20), r.randint(2, 15))
    den = p.denominator * q.denominator // math.gcd(p.denominator, q.denominator)
    pn, qn = p.numerator * (den // p.denominator), q.numerator * (den // q.denominator)
    steps = [f"The least common denominator of {p.denominator} and {q.denominator} is {den}.",
             f"{_frac(p)} = {pn}/{den} and {_frac(q)} = {qn}/{den}.",
             f"Adding the numerators: {pn + qn}/{den}, which simplifies to {_frac(Fraction(pn + qn, den))}."]
    assert Fraction(pn + qn, den) == p + q
    return f"Compute {_frac(p)} + {_frac(q)}.", steps, _frac(p + q)


def quadratic(r: random.Random):
    r1, r2 = sorted(r.sample(range(-15, 16), 2))
    s, prod = r1 + r2, r1 * r2
    steps = [f"We need two numbers with sum {s} and product {prod}: {r1} and {r2}.",
             f"So x^2 - ({s})x + ({prod}) = (x - ({r1}))(x - ({r2})).",
             f"Setting each factor to zero gives x = {r1} or x = {r2}."]
    roots = [x for x in range(-15, 16) if x * x - s * x + prod == 0]
    assert roots == [r1, r2], "brute-force root check"
    return f"Solve x^2 - ({s})x + ({prod}) = 0.", steps, f"{r1}, {r2}"


def arithmetic_series(r: random.Random):
    a, d, n = r.randint(-20, 40), r.randint(1, 12), r.randint(5, 60)
    last = a + (n - 1) * d
    total = n * (a + last) // 2
    steps = [f"The last term is {a} + ({n} - 1) x {d} = {last}.",
             f"The sum is n(first + last)/2 = {n} x ({a} + {last}) / 2 = {total}."]
    assert total == sum(a + i * d for i in range(n))
    return f"Find the sum of the first {n} terms of the arithmetic sequence {a}, {a + d}, {a + 2 * d}, ...", steps, str(total)


def modular_power(r: random.Random):
    base, exp, mod = r.randint(2, 50), r.randint(5, 90), r.randint(7, 97)
    steps, result, b, e = [], 1, base % mod, exp
    steps.append(f"Write {exp} in binary: {bin(exp)[2:]}. Square and multiply from the lowest bit.")
    while e:
        if e & 1:
            steps.append(f"Bit 1: result = {result} x {b} mod {mod} = {result * b % mod}.")
            result = result * b % mod
        e >>= 1
        if e:
            steps.append(f"Square: {b}^2 mod {mod} = {b * b % mod}.")
            b = b * b % mod
    assert result == pow(base, exp, mod)
    return f"Compute {base}^{exp} mod {mod}.", steps, str(result)


def linear_system(r: random.Random):
    x, y = r.randint(-12, 12), r.randint(-12, 12)
    while True:
        a, b, c, d = (r.choice([i for i in range(-9, 10) if i]) for _ in range(4))
        if a * d - b * c:
            break
    e, f = a * x + b * y, c * x + d * y
    det = a * d - b * c
    steps = [f"Multiply the first equation by {d} and the second by {b}, then subtract: "
             f"({a * d} - {b * c})x = {e * d} - {f * b}, so {det}x = {e * d - f * b} and x = {x}.",
             f"Substitute into the first equation: {b}y = {e} - ({a * x}) = {e - a * x}, so y = {y}."]
    assert a * x + b * y == e and c * x + d * y == f and Fraction(e * d - f * b, det) == x
    return (f"Solve the system {a}x + ({b})y = {e} and {c}x + ({d})y = {f}.", steps, f"x = {x}, y = {y}")


def factorize(r: random.Random):
    n = math.prod(r.choice([2, 2, 3, 3, 5, 7, 11, 13, 17, 19, 23]) for _ in range(r.randint(2, 6)))
    m, p, steps, factors = n, 2, [], []
    while m > 1:
        if m % p == 0:
            steps.append(f"{m} is divisible by {p}: {m} / {p} = {m // p}.")
            factors.append(p)
            m //= p
        else:
            p += 1
    assert math.prod(factors) == n and all(all(f % k for k in range(2, f)) for f in factors)
    return f"Find the prime factorization of {n}.", steps, " x ".join(map(str, factors))


GENERATORS = [linear_equation, shopping, euclid_gcd, fraction_sum, quadratic, arithmetic_series,
              modular_power, linear_system, factorize]


def render(problem: str, steps: list, answer: str) -> str:
    lines = [f"Problem: {problem}", "Solution:"]
    lines += [f"Step {i + 1}: {s}" for i, s in enumerate(steps)]
    lines.append(f"Answer: {answer}")
    return "\n".join(lines)


def generate(out_path: str, seed: int, max_bytes: int = 1_500_000) -> None:
    """Problems of every kind in a seeded order until ``max_bytes`` of text."""
    r = random.Random(seed)
    total = 0
    with open(out_path, "w", encoding="utf-8") as f:
        while total < max_bytes:
            gen = r.choice(GENERATORS)
            text = render(*gen(r))
            f.write(json.dumps({"text": text, "kind": gen.__name__}) + "\n")
            total += len(text)
