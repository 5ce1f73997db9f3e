"""Twenty texts and the schema each answer must follow: the structured-output tests of both
frameworks' adapters (LangChain's and LlamaIndex's) read them from here, so they measure the same.
Run by path (``runpy.run_path``), since the test folders are separate packages; no
``from __future__ import annotations`` here, so Pydantic needs no module to resolve the fields in."""

from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["CASES"]


class Person(BaseModel):
    """A person the text is about."""

    name: str = Field(description="the person's name")
    age: int = Field(description="age in years")


class Product(BaseModel):
    """A product offered for sale."""

    name: str
    price: float = Field(description="price in euros")
    in_stock: bool


class Sentiment(BaseModel):
    """How the text feels."""

    label: Literal["positive", "negative", "neutral"]


class Address(BaseModel):
    street: str
    city: str
    country: str


class Company(BaseModel):
    """A company and where it is."""

    name: str
    address: Address


class Trip(BaseModel):
    """A planned trip."""

    destination: str
    days: int
    companions: list[str] = Field(description="who goes along")
    budget_eur: float | None = Field(default=None, description="budget, when given")


CASES: list[tuple[type[BaseModel], str]] = [
    (Person, "Alice is 31 years old and lives in Porto."),
    (Person, "My neighbour Bob turned 45 last week."),
    (Person, "Dr. Chen, aged 52, runs the clinic."),
    (Person, "The youngest player, Marta, is only 17."),
    (Product, "The blue kettle costs 24.99 euros and is available now."),
    (Product, "Sorry, the 4K monitor (349 EUR) is sold out."),
    (Product, "Fresh bread: 2.50, we have plenty today."),
    (Sentiment, "I absolutely loved the concert last night!"),
    (Sentiment, "The delivery was late and the box was broken."),
    (Sentiment, "The meeting is at 3 pm in room 4."),
    (Sentiment, "What a wonderful surprise, thank you so much."),
    (Company, "Acme Tools is based at 12 Harbour Road, Lisbon, Portugal."),
    (Company, "Our office: Nordlicht GmbH, Hauptstrasse 5, Berlin, Germany."),
    (Company, "Blue Fern Ltd has its head office on 221 King Street in Toronto, Canada."),
    (Trip, "Next month I'm going to Madrid for 5 days with Ana and Luis, budget 900 euros."),
    (Trip, "We plan a week in Kyoto, just me and my sister Jo."),
    (Trip, "Weekend in Porto with Sam; about 300 EUR in total."),
    (Person, "Grandpa Joe celebrated his 80th birthday."),
    (Product, "Garden chairs at 45 euros each, currently in stock."),
    (Trip, "A 10-day hiking trip to Iceland with Priya, Tom and Kai."),
]
