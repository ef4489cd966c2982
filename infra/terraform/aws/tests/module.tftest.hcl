# Offline plan-level tests of the module (`terraform test`, mocked AWS provider):
# defaults wire up as documented and bad inputs are refused by validation.

mock_provider "aws" {
  mock_data "aws_partition" {
    defaults = { partition = "aws" }
  }
  mock_data "aws_region" {
    defaults = { name = "eu-west-1" }
  }
  mock_data "aws_caller_identity" {
    defaults = { account_id = "123456789012" }
  }
  mock_data "aws_iam_policy_document" {
    defaults = { json = "{}" }
  }
  mock_resource "aws_s3_bucket" {
    defaults = { arn = "arn:aws:s3:::kvgate-kv-test", id = "kvgate-kv-test" }
  }
  mock_resource "aws_cloudwatch_log_group" {
    defaults = { arn = "arn:aws:logs:eu-west-1:123456789012:log-group:/aws/lambda/kvgate" }
  }
}

variables {
  lambda_zip_path  = "tests/fixtures/empty.zip"
  auth_tokens_json = "{\"tokens\":[]}"
}

run "defaults" {
  command = plan

  assert {
    condition     = aws_lambda_function_url.this.invoke_mode == "RESPONSE_STREAM"
    error_message = "the function URL must stream responses"
  }
  assert {
    condition     = aws_lambda_function.this.runtime == "nodejs22.x" && aws_lambda_function.this.architectures[0] == "arm64"
    error_message = "nodejs22.x on arm64 by default"
  }
  assert {
    condition     = aws_cloudwatch_log_group.this.retention_in_days == 14
    error_message = "log retention must be set"
  }
  assert {
    condition     = one([for r in aws_s3_bucket_server_side_encryption_configuration.this.rule : one(r.apply_server_side_encryption_by_default).sse_algorithm]) == "AES256"
    error_message = "SSE-S3 by default"
  }
  assert {
    condition     = aws_s3_bucket_public_access_block.this.block_public_policy && aws_s3_bucket_public_access_block.this.restrict_public_buckets
    error_message = "the bucket must not be public"
  }
  assert {
    condition     = aws_ssm_parameter.this[0].type == "SecureString" && aws_ssm_parameter.this[0].name == "/kvgate/auth-tokens"
    error_message = "the token table is a SecureString the function reads"
  }
  assert {
    condition     = aws_lambda_function.this.environment[0].variables["KVGATE_AUTH_SSM_PARAMETER"] == "/kvgate/auth-tokens"
    error_message = "the function is told where the token table is"
  }
}

run "kms_and_existing_parameter" {
  command = plan

  variables {
    kms_key_arn         = "arn:aws:kms:eu-west-1:123456789012:key/0000-1111"
    auth_parameter_name = "/ops/kvgate/tokens"
    auth_tokens_json    = null
  }

  assert {
    condition     = one([for r in aws_s3_bucket_server_side_encryption_configuration.this.rule : one(r.apply_server_side_encryption_by_default).sse_algorithm]) == "aws:kms"
    error_message = "a KMS key switches the bucket to SSE-KMS"
  }
  assert {
    condition     = length(aws_ssm_parameter.this) == 0
    error_message = "an existing parameter is used, not created"
  }
}

run "rejects_public_storage_class_mistakes" {
  command = plan

  variables {
    cold_tier_storage_class   = "STANDARD_IA"
    cold_tier_transition_days = 7
  }

  expect_failures = [var.cold_tier_storage_class]
}

run "rejects_expiry_before_transition" {
  command = plan

  variables {
    cold_tier_transition_days = 60
    expiration_days           = 30
  }

  expect_failures = [var.expiration_days]
}

run "rejects_missing_auth" {
  command = plan

  variables {
    auth_tokens_json = null
  }

  expect_failures = [var.auth_parameter_name]
}

run "rejects_oversized_chunks" {
  command = plan

  variables {
    max_chunk_bytes = 8388608
  }

  expect_failures = [var.max_chunk_bytes]
}

run "function_url_permissions" {
  command = plan

  assert {
    condition     = aws_lambda_permission.this["url"].action == "lambda:InvokeFunctionUrl" && aws_lambda_permission.this["url"].function_url_auth_type == "NONE"
    error_message = "the URL needs a public InvokeFunctionUrl grant"
  }
  assert {
    condition     = aws_lambda_permission.this["invoke"].action == "lambda:InvokeFunction"
    error_message = "function URLs created since October 2025 also need lambda:InvokeFunction"
  }
}

run "function_url_permissions_opt_out" {
  command = plan

  variables {
    create_invoke_function_permission = false
  }

  assert {
    condition     = keys(aws_lambda_permission.this) == ["url"]
    error_message = "opting out leaves only the URL grant"
  }
}
