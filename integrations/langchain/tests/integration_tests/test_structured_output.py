"""Structured output and tool calls on the bundled 135M model: every answer parses and validates."""

from __future__ import annotations

from typing import Literal

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from langchain_kvshift import ChatKVShift


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


def test_structured_output_is_schema_valid_for_20_varied_prompts():
    llm = ChatKVShift(max_tokens=96)
    valid = 0
    for schema, text in CASES:
        answer = llm.with_structured_output(schema, include_raw=True).invoke(text)
        if answer["parsing_error"] is None and isinstance(answer["parsed"], schema):
            valid += 1
        else:
            print(schema.__name__, text, answer["raw"].content, answer["parsing_error"])
    assert valid == len(CASES) == 20


def test_a_tool_call_round_trip_reuses_the_call_it_made():
    @tool
    def convert_currency(amount: float, currency: str) -> str:
        """Convert an amount of euros into another currency."""
        return f"{amount * 1.1:.2f} {currency}"

    llm = ChatKVShift(max_tokens=64).bind_tools([convert_currency], tool_choice="any")
    question = HumanMessage("How much is 100 euros in dollars? Use the tool.")
    call = llm.invoke([question])
    assert [c["name"] for c in call.tool_calls] == ["convert_currency"]
    assert set(call.tool_calls[0]["args"]) == {"amount", "currency"}
    result = convert_currency.invoke(call.tool_calls[0])
    answer = (
        ChatKVShift(max_tokens=32).bind_tools([convert_currency], tool_choice="none").invoke([question, call, result])
    )
    assert answer.content and not answer.tool_calls
    details = answer.usage_metadata["input_token_details"]
    # the call came back as the model wrote it: the previous prompt and the call were read from cache,
    # up to where the model split the call's text into other tokens than the tokenizer does ('"}' '}'
    # against '"' '}}')
    assert details["cache_read"] >= call.usage_metadata["input_tokens"] + call.usage_metadata["output_tokens"] // 2
