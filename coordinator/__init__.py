"""The isthmus coordinator: membership, rounds, aggregation and the outer step."""
