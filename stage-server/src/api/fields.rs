//! Typed reads of a JSON request's fields: each wrong type or range is a 400 naming the field.

use serde_json::{Map, Value};

use super::error::ApiError;

/// The fields of one JSON object, read by name. A field set to `null` counts as absent, because many clients
/// send every optional parameter and fill the unset ones with `null`.
pub(super) struct Fields<'a> {
    object: &'a Map<String, Value>,
    /// Prepended to field names in errors (`messages[2].`), empty at the top level.
    path: String,
}

impl<'a> Fields<'a> {
    /// The top-level fields of a request body.
    pub(super) fn top(object: &'a Map<String, Value>) -> Self {
        Self {
            object,
            path: String::new(),
        }
    }

    /// The fields of an object nested at `path` (such as `messages[2]`).
    pub(super) fn nested(object: &'a Map<String, Value>, path: &str) -> Self {
        Self {
            object,
            path: format!("{path}."),
        }
    }

    /// The full name of field `name` in errors.
    pub(super) fn param(&self, name: &str) -> String {
        format!("{}{name}", self.path)
    }

    /// The field's value, `None` when absent or `null`.
    pub(super) fn get(&self, name: &str) -> Option<&'a Value> {
        self.object.get(name).filter(|value| !value.is_null())
    }

    /// A string field.
    pub(super) fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        let Some(value) = self.get(name) else {
            return Ok(None);
        };
        match value {
            Value::String(text) => Ok(Some(text)),
            other => Err(self.wrong_type(name, "a string", other)),
        }
    }

    /// A boolean field.
    pub(super) fn boolean(&self, name: &str) -> Result<Option<bool>, ApiError> {
        let Some(value) = self.get(name) else {
            return Ok(None);
        };
        match value {
            Value::Bool(flag) => Ok(Some(*flag)),
            other => Err(self.wrong_type(name, "a boolean", other)),
        }
    }

    /// An object field.
    pub(super) fn object(&self, name: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
        let Some(value) = self.get(name) else {
            return Ok(None);
        };
        match value {
            Value::Object(object) => Ok(Some(object)),
            other => Err(self.wrong_type(name, "an object", other)),
        }
    }

    /// A number field within `low..=high`.
    pub(super) fn number(&self, name: &str, low: f64, high: f64) -> Result<Option<f64>, ApiError> {
        let Some(value) = self.get(name) else {
            return Ok(None);
        };
        let Some(number) = value.as_f64() else {
            return Err(self.wrong_type(name, "a number", value));
        };
        if !(low..=high).contains(&number) {
            return Err(ApiError::invalid(
                &self.param(name),
                format!(
                    "`{}` must be between {low} and {high}; got {number}",
                    self.param(name)
                ),
            ));
        }
        Ok(Some(number))
    }

    /// An integer field within `low..=high`.
    pub(super) fn integer(
        &self,
        name: &str,
        low: i128,
        high: i128,
    ) -> Result<Option<i128>, ApiError> {
        let Some(value) = self.get(name) else {
            return Ok(None);
        };
        integer_in(value, &self.param(name), low, high).map(Some)
    }

    /// The 400 for a field of the wrong JSON type.
    pub(super) fn wrong_type(&self, name: &str, expected: &str, value: &Value) -> ApiError {
        wrong_type(&self.param(name), expected, value)
    }
}

/// `value` as an integer within `low..=high`, else a 400 naming `param`.
///
/// A float with no fraction (`5.0`, as Python's `json` writes a float) counts as that integer. Every JSON number
/// serde_json yields is a `u64`, an `i64` or a finite `f64`; the float cast saturates at `i128`'s bounds (far
/// past any field's range), so huge numbers are refused or clamped by the range, never wrapped.
pub(super) fn integer_in(
    value: &Value,
    param: &str,
    low: i128,
    high: i128,
) -> Result<i128, ApiError> {
    let number = if let Some(unsigned) = value.as_u64() {
        i128::from(unsigned)
    } else if let Some(signed) = value.as_i64() {
        i128::from(signed)
    } else if let Some(float) = value.as_f64().filter(|float| float.fract() == 0.0) {
        float as i128
    } else {
        return Err(wrong_type(param, "an integer", value));
    };
    if !(low..=high).contains(&number) {
        let message = if high == i128::MAX {
            format!("`{param}` must be at least {low}; got {value}")
        } else {
            format!("`{param}` must be between {low} and {high}; got {value}")
        };
        return Err(ApiError::invalid(param, message));
    }
    Ok(number)
}

/// The 400 for a value of the wrong JSON type at `param`.
pub(super) fn wrong_type(param: &str, expected: &str, value: &Value) -> ApiError {
    ApiError::invalid(
        param,
        format!("`{param}` must be {expected}; got {}", describe(value)),
    )
}

/// A short description of a JSON value for error text: its type, and the value itself when it is short.
pub(super) fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(flag) => format!("the boolean {flag}"),
        Value::Number(number) => format!("the number {number}"),
        Value::String(text) if text.chars().count() <= 32 => format!("the string {value}"),
        Value::String(_) => "a string".to_owned(),
        Value::Array(_) => "an array".to_owned(),
        Value::Object(_) => "an object".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn object(value: Value) -> Map<String, Value> {
        let Value::Object(object) = value else {
            panic!("the test built a non-object");
        };
        object
    }

    #[test]
    fn null_counts_as_absent() {
        let body = object(json!({"model": null, "top_k": null}));
        let fields = Fields::top(&body);
        assert_eq!(
            fields.string("model"),
            Ok(None),
            "a null string was not absent"
        );
        assert_eq!(
            fields.integer("top_k", 0, 10),
            Ok(None),
            "a null integer was not absent"
        );
    }

    #[test]
    fn a_whole_float_is_an_integer_and_a_fraction_is_not() {
        let whole = integer_in(&json!(5.0), "max_tokens", 1, 100);
        assert_eq!(whole, Ok(5), "5.0 was not read as 5");
        let fraction = integer_in(&json!(5.5), "max_tokens", 1, 100).unwrap_err();
        assert!(
            fraction.message.contains("an integer"),
            "the message does not say an integer was expected: {}",
            fraction.message
        );
    }

    #[test]
    fn huge_numbers_are_out_of_range_not_wrapped() {
        for huge in [
            json!(1e300),
            json!(-1e300),
            json!(u64::MAX),
            json!(i64::MIN),
        ] {
            let error = integer_in(&huge, "seed", 0, 10).unwrap_err();
            assert_eq!(
                error.param.as_deref(),
                Some("seed"),
                "{huge} named the wrong field"
            );
        }
        let error = integer_in(&json!(-1e300), "max_tokens", 1, i128::MAX).unwrap_err();
        assert_eq!(
            error.message,
            "`max_tokens` must be at least 1; got -1e+300"
        );
        assert_eq!(
            integer_in(&json!(1e300), "max_tokens", 1, i128::MAX),
            Ok(i128::MAX),
            "a huge whole float did not saturate"
        );
        assert_eq!(
            integer_in(&json!(u64::MAX), "seed", 0, i128::from(u64::MAX)),
            Ok(i128::from(u64::MAX)),
            "the largest u64 was refused"
        );
    }

    #[test]
    fn nested_fields_carry_their_path() {
        let message = object(json!({"role": 7}));
        let error = Fields::nested(&message, "messages[3]")
            .string("role")
            .unwrap_err();
        assert_eq!(error.param.as_deref(), Some("messages[3].role"));
        assert_eq!(
            error.message,
            "`messages[3].role` must be a string; got the number 7"
        );
    }

    #[test]
    fn a_number_outside_its_range_names_the_bounds() {
        let body = object(json!({"top_p": 1.5}));
        let error = Fields::top(&body).number("top_p", 0.0, 1.0).unwrap_err();
        assert_eq!(error.message, "`top_p` must be between 0 and 1; got 1.5");
    }
}
