"""A few kilobytes of varied English (facts, dialogue, code, lists, instructions) written for this
project: the default calibration sample of ``engine.weight_only.awq``. Sections are separated by a
blank line; the calibration reads them as several sequences so that each kind of text is seen."""

CALIBRATION_TEXT = """\
The river that runs through the old market town rises in a peat bog about forty kilometres to the
north. For most of the year it is shallow enough to wade across below the mill, but after the
autumn rains it can climb three metres in a single night. The stone bridge was built in 1764
after the wooden one before it was carried away, and the flood marks cut into its eastern pier
show that the water has reached the parapet twice since then. Today the mill houses a small
museum, a bakery and a workshop where volunteers repair clocks on Saturday mornings.

"Are you sure this is the right platform?" Maya asked, checking the board again.
"Platform four, the 9:42 to Leeds," said her brother. "It says delayed, not cancelled."
"Delayed by how much?"
"It doesn't say. Do you want a coffee while we wait? The kiosk takes cards now."
"Tea, please. And if the train comes while you're in the queue, I'm not holding the doors."
He laughed and walked off, and a minute later the announcement crackled: the service would
depart from platform two instead, and passengers were asked to use the footbridge.

def moving_average(values, window):
    \"\"\"Return the mean of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages

print(moving_average([3, 5, 7, 9, 11], 2))  # [4.0, 6.0, 8.0, 10.0]

Packing list for a two-day hike:
1. Waterproof jacket and a spare pair of wool socks.
2. Two litres of water, a filter, and purification tablets as a backup.
3. Map, compass and a charged phone in a sealed bag.
4. Lunch for both days, plus nuts, dried fruit and chocolate for the climbs.
5. First aid kit: plasters, blister pads, bandage, painkillers, tweezers.
6. Head torch with fresh batteries; the forest gets dark early in October.

Photosynthesis converts light energy into chemical energy. In the chloroplasts of a leaf, water
molecules are split, releasing oxygen, while carbon dioxide taken in through small pores is fixed
into sugars. A mature oak can release enough oxygen in a summer day for a few people, though the
oceans, where microscopic algae do the same work, supply roughly half of the oxygen in the air.

To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and watch
the lights on the front panel: the power light turns green first, then the internet light blinks
while the connection is negotiated. If the internet light stays red after five minutes, press the
recessed button on the back with a paper clip for ten seconds, then set up the network again
using the name and password printed on the label underneath.

SELECT customer_id, COUNT(*) AS orders, SUM(total) AS spent
FROM orders
WHERE created_at >= '2023-01-01'
GROUP BY customer_id
HAVING COUNT(*) > 3
ORDER BY spent DESC
LIMIT 10;

Q: Why does ice float on water?
A: Because water expands as it freezes. The molecules lock into an open hexagonal lattice held
together by hydrogen bonds, so a litre of ice weighs about nine tenths as much as a litre of
liquid water, and the lighter solid rises to the top.

Dear Mr. Okafor, thank you for your letter of 12 March. I am sorry to hear that the replacement
kettle also stopped working after a week. We will send a courier to collect it on Thursday
between 10 a.m. and 2 p.m., and a full refund of 34.99 pounds will reach your account within five
working days of its arrival at our depot. Please keep the receipt until then. Kind regards,
Helen Marsh, Customer Services.

The history of the printing press is often told as the story of one man, but movable type was
used in Korea and China centuries before Gutenberg. What changed in fifteenth-century Mainz was
the combination: a hand mould that cast identical metal letters quickly, an oil-based ink that
clung to them, and a screw press adapted from wine making. Within fifty years there were presses
in more than two hundred European towns, and the price of a book had fallen to a fraction of what
a copied manuscript cost.

for (let i = 1; i <= 15; i++) {
  const word = (i % 3 === 0 ? "Fizz" : "") + (i % 5 === 0 ? "Buzz" : "");
  console.log(word || i);
}

The recipe serves four. Soften one chopped onion in olive oil over a low heat, add two cloves of
garlic, a teaspoon of cumin and a pinch of chilli flakes, and stir for a minute. Tip in a tin of
tomatoes, 250 grams of red lentils and 800 millilitres of stock, then simmer for twenty minutes
until the lentils collapse. Season with salt, lemon juice and plenty of black pepper.

Interviewer: What made you start running marathons at the age of sixty?
Runner: Honestly, a bet with my granddaughter. She said I couldn't do five kilometres without
stopping, so I trained for a month and did it. Then I thought, well, why not ten? By the next
spring I was standing at the start line in Rotterdam, terrified and very happy.
Interviewer: And how many have you finished since?
Runner: Eleven. The slowest was Berlin, in the rain, but that is the one I remember best.

Mars has two small moons, Phobos and Deimos, both probably captured asteroids. A day on Mars lasts
24 hours and 37 minutes, and its year lasts 687 Earth days. Its thin atmosphere, mostly carbon
dioxide, exerts less than one percent of the pressure at sea level on Earth, so liquid water
boils away quickly at the surface, although ice is found at the poles and under the dust.
"""
